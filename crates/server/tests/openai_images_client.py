"""The official openai SDK's images API against a running `tessera serve` with the bundled
miniature Z-Image (argv: base URL, API key, model id).

`client.images.generate` with `response_format="b64_json"` gives a PNG of the size asked; `n=2`
two different images; the same `seed` (Tessera's extension, through `extra_body`) the same bytes;
`stream=True` with `partial_images` the step events, the previews, then the image. Exits
non-zero on any mismatch.
"""

import base64
import struct
import sys

from openai import OpenAI


def png_size(data):
    """Width and height from a PNG's IHDR chunk (the standard library has no PNG decoder)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR", data[12:16]
    return struct.unpack(">II", data[16:24])


def main():
    url, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)

    cards = {m.id: m for m in client.models.list().data}
    assert model in cards, list(cards)

    r = client.images.generate(model=model, prompt="a red fox in the snow", size="64x64",
                               response_format="b64_json")
    assert r.created > 0 and len(r.data) == 1, r
    one = base64.b64decode(r.data[0].b64_json)
    assert png_size(one) == (64, 64), png_size(one)
    assert r.output_format == "png", r.output_format

    two = client.images.generate(model=model, prompt="a red fox in the snow", size="64x64",
                                 response_format="b64_json", n=2)
    assert len(two.data) == 2, two
    a, b = (base64.b64decode(d.b64_json) for d in two.data)
    assert png_size(a) == png_size(b) == (64, 64)
    assert a != b, "n=2 gave the same image twice"

    seeded = [
        client.images.generate(model=model, prompt="a lighthouse", size="64x48",
                               response_format="b64_json", extra_body={"seed": 1234,
                                                                       "num_inference_steps": 3})
        for _ in range(2)
    ]
    x, y = (base64.b64decode(s.data[0].b64_json) for s in seeded)
    assert png_size(x) == (64, 48)
    assert x == y, "the same seed gave different bytes"
    assert seeded[0].data[0].model_extra.get("seed") == 1234, seeded[0].data[0]

    # Streaming through the SDK: Tessera's step events, the previews, the image.
    events = list(client.images.generate(model=model, prompt="a lighthouse", size="64x48",
                                         stream=True, partial_images=1,
                                         extra_body={"seed": 1234, "num_inference_steps": 3}))
    kinds = [e.type for e in events]
    assert kinds == ["image_generation.step", "image_generation.step",
                     "image_generation.partial_image", "image_generation.step",
                     "image_generation.completed"], kinds
    assert base64.b64decode(events[-1].b64_json) == x, "the streamed image differs"

    # An error comes back as the SDK's typed exception with the server's message.
    try:
        client.images.generate(model=model, prompt="x", size="65x64", response_format="b64_json")
    except Exception as e:  # openai.BadRequestError
        assert getattr(e, "status_code", None) == 400, e
        assert "16" in str(e), e
    else:
        raise AssertionError("size 65x64 was accepted")
    try:
        client.images.generate(model=model, prompt="x", size="64x64", response_format="url")
    except Exception as e:
        assert getattr(e, "status_code", None) == 400 and "inline" in str(e), e
    else:
        raise AssertionError("response_format url was accepted")
    print("openai client: ok")


if __name__ == "__main__":
    main()
