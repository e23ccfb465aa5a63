"""The official openai SDK against a running `tessera serve` (argv: base URL, API key).

The model list and one model retrieved (an unknown one a NotFoundError), one text request (the
SDK's default base64 encoding, then float), one image request (a text + image content array as
one input) with `dimensions`. Exits non-zero on any mismatch.
"""

import base64
import math
import struct
import sys
import zlib

import openai
from openai import OpenAI


def png(width, height):
    """A small RGB gradient PNG, written with the standard library."""
    rows = b"".join(
        b"\x00" + bytes(v for x in range(width) for v in (x * 255 // width, y * 255 // height, (x + y) % 256))
        for y in range(height)
    )

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def unit(v):
    n = math.sqrt(sum(x * x for x in v))
    assert abs(n - 1.0) < 1e-4, f"not unit length: {n}"


def main():
    url, key = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)

    ids = [m.id for m in client.models.list().data]
    assert "egemma2-mini" in ids and "egemma2-mini:query" in ids, ids
    # Retrieve one model, and the SDK's NotFoundError for an unknown one.
    for id in ("egemma2-mini", "egemma2-mini:query"):
        m = client.models.retrieve(id)
        assert (m.id, m.object, m.owned_by) == (id, "model", "tessera"), m
    try:
        client.models.retrieve("gpt-4o")
        raise AssertionError("an unknown model was retrieved")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.code == "model_not_found", e

    # Text: the SDK asks for base64 by default and decodes it.
    r = client.embeddings.create(model="egemma2-mini:query", input="which planet is red?")
    v64 = r.data[0].embedding
    assert len(v64) == 48, len(v64)
    unit(v64)
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens
    f = client.embeddings.create(
        model="egemma2-mini", input="which planet is red?", encoding_format="float",
        extra_body={"prompt_name": "query"},
    )
    assert max(abs(a - b) for a, b in zip(v64, f.data[0].embedding)) < 1e-6

    # Image: one input made of a text part and an image part, Matryoshka 16.
    image = "data:image/png;base64," + base64.b64encode(png(40, 30)).decode()
    r = client.embeddings.create(
        model="egemma2-mini",
        input=[[{"type": "text", "text": "a chart of "}, {"type": "image_url", "image_url": {"url": image}}]],
        dimensions=16,
        encoding_format="base64",
    )
    assert len(r.data) == 1
    v = r.data[0].embedding
    if isinstance(v, str):  # an explicit encoding_format is returned as the server sent it
        v = list(struct.unpack(f"<{len(base64.b64decode(v)) // 4}f", base64.b64decode(v)))
    assert len(v) == 16, len(v)
    unit(v)
    assert r.usage.prompt_tokens > 10, r.usage

    # An error comes back as the SDK's typed exception with the server's message.
    try:
        client.embeddings.create(model="egemma2-mini", input="x", dimensions=10_000)
    except Exception as e:  # openai.BadRequestError
        assert getattr(e, "status_code", None) == 400, e
        assert "dimensions" in str(e), e
    else:
        raise AssertionError("dimensions 10000 was accepted")
    print("openai client: ok")


if __name__ == "__main__":
    main()
