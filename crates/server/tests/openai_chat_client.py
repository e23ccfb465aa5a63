"""The official openai SDK against a `tessera serve` of a chat model (argv: base URL, API key,
a JSON file with the request's image path, question and max_tokens, and the reply the runtime
gives: text, token counts, finish reason).

An image question with `chat.completions.create` (an image data URL and a text part, greedy),
whole and streamed with usage; the models list; an unsupported field as the SDK's typed error.
Exits non-zero on any mismatch.
"""

import base64
import json
import sys

from openai import OpenAI


def main():
    url, key, expected_path = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(expected_path, encoding="utf-8") as f:
        want = json.load(f)
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)

    models = client.models.list().data
    assert [m.id for m in models] == [want["model"]], models
    assert getattr(models[0], "capability", None) == "chat", models[0]

    with open(want["image"], "rb") as f:
        image = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image, "detail": "auto"}},
        {"type": "text", "text": want["question"]},
    ]}]

    r = client.chat.completions.create(
        model=want["model"], messages=messages, temperature=0, max_tokens=want["max_tokens"],
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-"), r
    assert len(r.choices) == 1, r.choices
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want["text"], (choice.message.content, want["text"])
    assert choice.finish_reason == want["finish_reason"], choice.finish_reason
    u = r.usage
    assert u.prompt_tokens == want["prompt_tokens"], u
    assert u.completion_tokens == want["completion_tokens"], u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u

    # Streamed: the same text in pieces, the finish reason, then the usage.
    stream = client.chat.completions.create(
        model=want["model"], messages=messages, temperature=0, max_tokens=want["max_tokens"],
        stream=True, stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason is not None:
                finish = c.finish_reason
    assert len(pieces) > 1, pieces
    assert "".join(pieces) == want["text"], ("".join(pieces), want["text"])
    assert finish == want["finish_reason"], finish
    assert usage is not None and usage.completion_tokens == want["completion_tokens"], usage

    # What the server cannot do comes back as the SDK's typed exception with the message.
    try:
        client.chat.completions.create(model=want["model"], messages=messages, n=2, max_tokens=2)
    except Exception as e:  # openai.BadRequestError
        assert getattr(e, "status_code", None) == 400, e
        assert "n = 2" in str(e), e
    else:
        raise AssertionError("n=2 was accepted")
    print("openai client: ok")


if __name__ == "__main__":
    main()
