"""Copy as code: the `curl`, `openai` and Python (`synthesize`) calls that reproduce a take of the playground page.

Each is written from the take's request body (`Take.fields`: the text, voice, settings and the seed it used), so
the curl and `openai` calls send exactly the page's request and get its audio back; `synthesize` with the same seed
and settings speaks the same audio in Python (the server's requests are `synthesize`'s, chunk for chunk).
"""

from __future__ import annotations

import json
import shlex

from ..voice import VOICE_FILE_SUFFIX
from .app import MORE_SAMPLING

KEY_VARIABLE = "DRAMA3_API_KEY"
OPENAI_FIELDS = ("model", "voice", "input", "response_format")  # the SDK's own arguments; the rest go in extra_body


def curl_command(base_url: str, fields: dict, with_key: bool, output: str = "take.wav") -> str:
    """A shell command that sends the request and writes the audio to `output`."""
    key = f' -H "Authorization: Bearer ${KEY_VARIABLE}"' if with_key else ""
    body = json.dumps(fields, ensure_ascii=False)
    return (f"curl -sS --fail-with-body {base_url}/v1/audio/speech{key} -H 'Content-Type: application/json' \\\n"
            f"    -d {shlex.quote(body)} \\\n    -o {shlex.quote(output)}")


def openai_code(base_url: str, fields: dict, with_key: bool) -> str:
    """The same request with the official `openai` client (Drama 3's fields in `extra_body`)."""
    key = f'os.environ["{KEY_VARIABLE}"]' if with_key else '"-"'
    extra = {name: value for name, value in fields.items() if name not in OPENAI_FIELDS}
    return "\n".join([
        "import os" if with_key else "",
        "from openai import OpenAI",
        "",
        f"client = OpenAI(base_url={base_url + '/v1'!r}, api_key={key})",
        "speech = client.audio.speech.create(",
        f"    model={fields['model']!r}, voice={fields['voice']!r}, response_format={fields['response_format']!r},",
        f"    input={fields['input']!r},",
        f"    extra_body={extra!r},",
        ")",
        'speech.write_to_file("take.wav")',
    ]).lstrip()


def synthesize_code(model: str, fields: dict, voices_dir: str | None, chunk_bytes: int) -> str:
    """The same speech in Python with `synthesize`: the checkpoint, the voice file, the seed, the settings and the
    server's chunk size."""
    settings = {name: fields[name] for name in ("temperature", "top_p", "top_k", "max_new_tokens", *MORE_SAMPLING)
                if name in fields}
    if settings.get("temperature") == 0:  # the HTTP API's greedy is Python's do_sample=False
        settings = {"do_sample": False, **{k: v for k, v in settings.items() if k == "max_new_tokens"}}
    voice = fields["voice"]
    lines = [
        "from transformers_drama3 import Drama3Processor, Drama3Voice, FishOmniForSpeech",
        "from transformers_drama3.audio_io import write_audio",
        "from transformers_drama3.synthesis import synthesize",
        "",
        f"model = FishOmniForSpeech.from_pretrained({model!r})",
        f"processor = Drama3Processor.from_pretrained({model!r}, codec=model.codec)",
    ]
    if voice != "default":
        folder = voices_dir or "voices"
        lines.append(f"references = [Drama3Voice.load({f'{folder}/{voice}{VOICE_FILE_SUFFIX}'!r})]")
    else:
        lines.append("references = None")
    settings["chunk_bytes"] = chunk_bytes
    arguments = "".join(f", {name}={value!r}" for name, value in settings.items())
    lines += [
        f"speech = synthesize(model, processor, {fields['input']!r}, references, seed={fields['seed']!r}{arguments})",
        'write_audio("take.wav", speech.audio, speech.sampling_rate)',
    ]
    return "\n".join(lines)
