"""The openai package against `nibble serve --model`: one whole and one streamed chat completion
at temperature 0. Usage: openai_client.py BASE_URL PROMPT MAX_TOKENS; prints one JSON object."""
import json
import sys

from openai import OpenAI

base, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = OpenAI(base_url=base, api_key="unused")
model = client.models.list().data[0].id
messages = [{"role": "user", "content": prompt}]
whole = client.chat.completions.create(
    model=model, messages=messages, max_tokens=max_tokens, temperature=0
)
streamed, stream_usage = "", None
for chunk in client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=max_tokens,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
):
    if chunk.choices and chunk.choices[0].delta.content:
        streamed += chunk.choices[0].delta.content
    if chunk.usage is not None:
        stream_usage = chunk.usage.model_dump()
print(
    json.dumps(
        {
            "text": whole.choices[0].message.content,
            "finish_reason": whole.choices[0].finish_reason,
            "prompt_tokens": whole.usage.prompt_tokens,
            "completion_tokens": whole.usage.completion_tokens,
            "streamed": streamed,
            "stream_usage": stream_usage,
        }
    )
)
