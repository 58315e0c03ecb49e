"""Talk to `drama3-serve` with the official `openai` client: one WAV file, then a streamed PCM response.

    python examples/speech_server.py                               # starts a tiny server in this process
    python examples/speech_server.py --url http://127.0.0.1:8000 --api-key KEY    # a running drama3-serve

Needs `pip install "transformers-drama3[serve]" openai`. Without `--url` a server on the embedded tiny random
checkpoint runs in a background thread (`ServerThread`); it speaks noise. docs/serving.md describes the API.
"""

import contextlib
import time

import openai

from example_setup import server_parser, server_url


def main() -> None:
    parser = server_parser(__doc__)
    parser.add_argument("--text", default="<|speaker:0|> Did you buy the bread? <|speaker:1|> Of course I did.")
    args = parser.parse_args()

    with contextlib.ExitStack() as stack:
        url = server_url(stack, args)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=args.api_key or "none")
        extra = {"seed": 0, "max_new_tokens": 48}  # Drama 3 fields, sent along with OpenAI's

        speech = client.audio.speech.create(model=args.model, voice="default", input=args.text,
                                            response_format="wav", extra_body=extra)
        speech.write_to_file("speech.wav")
        print(f"speech.wav: {len(speech.content)} bytes")

        start, first, size = time.perf_counter(), None, 0
        with client.audio.speech.with_streaming_response.create(
            model=args.model, voice="default", input=args.text, response_format="pcm", extra_body=extra
        ) as response, open("speech.pcm", "wb") as out:
            rate = int(response.headers["x-sample-rate"])
            for piece in response.iter_bytes():
                first = first or time.perf_counter() - start
                size += len(piece)
                out.write(piece)
        print(f"speech.pcm: {size / 2 / rate:.2f} s of 16-bit mono audio at {rate} Hz, first audio after {first:.2f} s "
              f"(play it with: ffplay -f s16le -ar {rate} -ac 1 speech.pcm)")


if __name__ == "__main__":
    main()
