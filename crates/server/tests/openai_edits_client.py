"""The official openai SDK's image edits against a running `tessera serve` with the bundled
miniature Qwen-Image-2.1 (argv: base URL, API key, model id, a condition PNG, another one).

`client.images.edit` with one image and with a list of two (sent as `image[]`) gives a PNG of
the last image's aspect; the same `seed` (Tessera's extension, through `extra_body`, which the SDK
sends as form fields) the same bytes; a streamed edit the step events, then the image; an error
the SDK's typed exception with the server's message. Exits non-zero on any mismatch.
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
    url, key, model, first, second = sys.argv[1:6]
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    extra = {"seed": 77, "num_inference_steps": 2, "output_resolution": 96}

    def files(*paths):
        return [("c%d.png" % i, open(p, "rb").read(), "image/png") for i, p in enumerate(paths)]

    one = client.images.edit(model=model, image=files(first)[0], prompt="make the fox blue",
                             response_format="b64_json", extra_body=extra)
    assert one.created > 0 and len(one.data) == 1, one
    a = base64.b64decode(one.data[0].b64_json)
    # tall_37x100 at output resolution 96: 64×160.
    assert png_size(a) == (64, 160), png_size(a)
    assert one.data[0].model_extra.get("seed") == 77, one.data[0]

    again = client.images.edit(model=model, image=files(first)[0], prompt="make the fox blue",
                               response_format="b64_json", extra_body=extra)
    assert base64.b64decode(again.data[0].b64_json) == a, "the same seed gave different bytes"

    # Two images (the SDK sends a list as image[]); the size is the last one's.
    two = client.images.edit(model=model, image=files(second, first), prompt="put them together",
                             response_format="b64_json", extra_body=extra)
    assert png_size(base64.b64decode(two.data[0].b64_json)) == (64, 160)
    swapped = client.images.edit(model=model, image=files(first, second), prompt="put them together",
                                 response_format="b64_json", extra_body=extra)
    # wide_203x61 at 96: 160×64.
    assert png_size(base64.b64decode(swapped.data[0].b64_json)) == (160, 64)

    # Streamed: the step events, then the image.
    events = list(client.images.edit(model=model, image=files(first)[0], prompt="make the fox blue",
                                     stream=True, extra_body=extra))
    kinds = [e.type for e in events]
    assert kinds == ["image_edit.step", "image_edit.step", "image_edit.completed"], kinds
    assert base64.b64decode(events[-1].b64_json) == a, "the streamed image differs"

    try:
        client.images.edit(model=model, image=files(first)[0], prompt="x", response_format="b64_json",
                           extra_body={"output_resolution": 32})
    except Exception as e:  # openai.BadRequestError
        assert getattr(e, "status_code", None) == 400, e
        assert "condition image 1" in str(e), e
    else:
        raise AssertionError("a 32-pixel condition copy was accepted")
    print("openai client: ok")


if __name__ == "__main__":
    main()
