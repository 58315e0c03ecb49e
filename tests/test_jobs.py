"""Manifest jobs (`drama3-tts --manifest`, `transformers_drama3.jobs`): the manifest and its items' files checked
before any model loads (every problem in one message), a 16-item job with an item that fails while it runs, the same
files byte for byte under `accelerate launch --num_processes 2` and under `torchrun --nproc_per_node 2` (gloo), both
ranks busy even on a 6-item job, and a job killed halfway that a rerun finishes by making only the missing items. The
golden tiny checkpoint, 4 frames per item: the audio is noise, but the same noise is the point."""

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from transformers_drama3 import cli, loading
from transformers_drama3.jobs import RECORDS_FOLDER, plan_job, records_in, run_manifest
from transformers_drama3.jobs_items import ManifestError, read_manifest
from transformers_drama3.processing_drama3 import Drama3Processor

from .conftest import GOLDEN_TINY

FRAMES, BATCH, CHUNK_BYTES = 4, 4, 40
BAD_ITEM = "item07"
LONG_ITEM = "item12"  # several chunks at CHUNK_BYTES: spoken by synthesize, not batched
TEXTS = ["Hello there.", "Good morning to you all.", "Yes.", "What a day it has been, truly.", "No!",
         "Maybe later then.", "The quick brown fox.", "It rains.", "We will see.", "Over the hills and far away.",
         "Ok.", "Really?", "First part of it, a longer one. Second part of it, longer too.", "That was fun.",
         "Goodbye for now.", "See you."]
TIMEOUT = 600
CLI_FLAGS = ["--model", str(GOLDEN_TINY), "--max-new-tokens", str(FRAMES), "--chunk-bytes", str(CHUNK_BYTES)]
TRANSIENT = ("run", "rank", "time_s", "batch_size")  # record fields that say how an item was made, not what


def write_cut_flac(path: Path) -> None:
    """A FLAC file cut in half: its header reads (so the checks before loading pass), its samples do not."""
    soundfile.write(path, np.random.default_rng(0).uniform(-0.5, 0.5, 44100).astype(np.float32), 44100)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])


def write_manifest(folder: Path) -> Path:
    """16 items, one of them (line 8) with a recording that cannot be decoded, one in flac, one in mp3."""
    write_cut_flac(folder / "cut.flac")
    lines = []
    for index, text in enumerate(TEXTS):
        item = {"id": f"item{index:02d}", "text": text}
        if item["id"] == BAD_ITEM:
            item["references"] = [{"audio": "cut.flac", "transcript": "Cut short."}]
        if index in (3, 5):
            item["format"] = {3: "flac", 5: "mp3"}[index]
        lines.append(json.dumps(item))
    path = folder / "jobs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def environment() -> dict:
    variables = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(cli.__file__).parents[1])}
    variables.pop("WORLD_SIZE", None)
    return variables


def results(folder: Path) -> dict:
    return {record["id"]: record for record in records_in(folder / "results.jsonl")}


def what_was_made(records: dict) -> dict:
    """The records without the fields that say how an item was made (which run, rank, batch; how long)."""
    return {key: {name: value for name, value in record.items() if name not in TRANSIENT}
            for key, record in records.items()}


def files(folder: Path) -> dict:
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.suffix in (".wav", ".flac", ".mp3")}


@pytest.fixture(scope="module")
def model():
    """Loaded as the CLI loads it, so that its files can be compared with the CLI's byte for byte."""
    return loading.load_model(str(GOLDEN_TINY), "cpu", torch.float32), Drama3Processor.from_pretrained(GOLDEN_TINY)


@pytest.fixture(scope="module")
def job(tmp_path_factory, model):
    """(manifest, output folder) of the reference run: one process, through the Python API."""
    folder = tmp_path_factory.mktemp("job")
    manifest = write_manifest(folder)
    summary = run_manifest(*model, manifest, folder / "out", batch_size=BATCH, chunk_bytes=CHUNK_BYTES,
                           show_progress=False, max_new_tokens=FRAMES)
    assert (summary.done, summary.skipped, summary.failed) == (15, 0, 1)
    return manifest, folder / "out"


def test_a_bad_item_is_recorded_and_the_job_goes_on(job):
    manifest, out = job
    records = results(out)
    assert list(records) == [f"item{index:02d}" for index in range(16)]  # in manifest order
    bad = records.pop(BAD_ITEM)
    assert bad["status"] == "failed" and "cut.flac" in bad["error"] and "cannot read audio" in bad["error"]
    assert not (out / f"{BAD_ITEM}.wav").exists()
    assert all(record["status"] == "done" and (out / record["file"]).is_file() for record in records.values())
    assert records["item03"]["file"] == "item03.flac" and records["item05"]["file"] == "item05.mp3"
    assert soundfile.info(out / "item05.mp3").format == "MP3"
    assert records[LONG_ITEM]["chunks"] > 1 and records["item00"]["chunks"] == 1
    assert all(record["frames"] <= FRAMES * record["chunks"] and record["seconds"] > 0 for record in records.values())
    assert not list((out / RECORDS_FOLDER).iterdir())  # merged into results.jsonl


def test_a_rerun_skips_done_items_and_redoes_a_changed_or_failed_one(job, model, tmp_path):
    manifest, out = job
    shutil.copytree(out, tmp_path / "out")
    before = files(tmp_path / "out")
    lines = manifest.read_text().splitlines()
    lines[1] = json.dumps({"id": "item01", "text": "Changed text."})
    changed = tmp_path / "jobs.jsonl"
    changed.write_text("\n".join(lines) + "\n")
    shutil.copy(manifest.parent / "cut.flac", tmp_path)
    summary = run_manifest(*model, changed, tmp_path / "out", batch_size=BATCH, chunk_bytes=CHUNK_BYTES,
                           show_progress=False, max_new_tokens=FRAMES)
    assert (summary.done, summary.skipped, summary.failed) == (1, 14, 1)
    after = files(tmp_path / "out")
    assert {name for name in after if after[name] != before[name]} == {"item01.wav"}
    assert results(tmp_path / "out")["item01"]["run"] != results(out)["item01"]["run"]


def job_to_kill(manifest: Path, out: Path) -> None:
    """The job of `test_a_killed_job_is_finished_by_a_rerun_that_makes_only_the_missing_items`, in a process of its
    own: it loads the model as the `model` fixture does and makes one item at a time."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a test run in the background ignores SIGINT
    model = loading.load_model(str(GOLDEN_TINY), "cpu", torch.float32), Drama3Processor.from_pretrained(GOLDEN_TINY)
    run_manifest(*model, manifest, out, batch_size=1, chunk_bytes=CHUNK_BYTES, show_progress=False,
                 max_new_tokens=FRAMES)


def test_a_killed_job_is_finished_by_a_rerun_that_makes_only_the_missing_items(job, model, tmp_path):
    """The job runs in a process of its own, killed with SIGKILL once it has recorded 4 items; the rerun here makes
    the others, and every file equals the uninterrupted run's. The process is spawned, not forked: a forked copy
    shares this process's locks (tqdm's write lock among them), and one it held when killed would block the rerun
    forever."""
    manifest, out = job
    process = multiprocessing.get_context("spawn").Process(target=job_to_kill, args=(manifest, tmp_path / "out"),
                                                           daemon=True)
    process.start()
    records_dir, deadline = tmp_path / "out" / RECORDS_FOLDER, time.monotonic() + TIMEOUT
    parts = []
    while time.monotonic() < deadline and process.is_alive():
        parts = list(records_dir.glob("*.jsonl")) if records_dir.is_dir() else []
        if parts and len(records_in(parts[0])) >= 4:
            process.kill()
            break
        time.sleep(0.01)
    process.join(TIMEOUT)
    assert process.exitcode == -signal.SIGKILL, "the job ended before it could be killed"
    first = records_in(parts[0])
    killed = {record["id"] for record in first if record["status"] == "done"}
    assert 3 <= len(killed) < 15 and not (tmp_path / "out" / "results.jsonl").exists()

    missing = sorted({f"item{index:02d}" for index in range(16)} - killed - {BAD_ITEM})
    (tmp_path / "out" / f".{missing[0]}.wav.0123456789ab.tmp").write_bytes(b"RIFF")  # as a kill mid-write leaves it
    summary = run_manifest(*model, manifest, tmp_path / "out", batch_size=BATCH, chunk_bytes=CHUNK_BYTES,
                           show_progress=False, max_new_tokens=FRAMES)
    assert (summary.done, summary.skipped, summary.failed) == (15 - len(killed), len(killed), 1)
    made_now = {key for key, record in results(tmp_path / "out").items()
                if record["status"] == "done" and record["run"] != first[0]["run"]}
    assert made_now == set(missing)
    assert files(tmp_path / "out") == files(out)
    assert not [path for path in (tmp_path / "out").iterdir() if path.name.endswith(".tmp")]


def test_text_files_speakers_and_seeds_from_the_item(tmp_path):
    """`text_file` is read relative to the manifest, `speaker` tags untagged text, an item's seed depends on its id
    (and the base seed), not on its line; the plan batches by length and never mixes settings."""
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("Read from a file, a rather long line.", encoding="utf-8")
    lines = [{"id": "a", "text_file": "texts/a.txt", "speaker": 2}, {"id": "b", "text": "<|speaker:1|> Tagged."},
             {"id": "c", "text": "Hi.", "greedy": True}, {"id": "d", "text": "Hello there."}]
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    reversed_manifest = tmp_path / "reversed.jsonl"
    reversed_manifest.write_text("".join(json.dumps(line) + "\n" for line in lines[::-1]))
    items = read_manifest(manifest)
    assert [item.seed for item in items] == [item.seed for item in read_manifest(reversed_manifest)][::-1]
    assert items[0].seed != read_manifest(manifest, base_seed=1)[0].seed
    assert items[2].settings == {"do_sample": False}
    plan = plan_job(items, tmp_path / "out", Drama3Processor.from_pretrained(GOLDEN_TINY), batch_size=2)
    assert plan.prepared[0][1] == ["<|speaker:2|> Read from a file, a rather long line."]
    assert plan.prepared[1][1] == ["<|speaker:1|> Tagged."]
    assert plan.batches == [[2], [1, 3], [0]]  # by length, c alone (greedy): "Hi." < "Tagged." < "Hello there." < a


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not valid JSON"),
    ('["a list"]', "line 2: each line must be a JSON object"),
    ('{"id": "x", "text": "Hi.", "colour": "red"}', "line 2: unknown field(s) ['colour']"),
    ('{"id": "a", "text": "Hi."}', "line 2: id 'a' is used on jobs.jsonl line 1 too"),
    ('{"id": "../up", "text": "Hi."}', "line 2: id must be 1-128 letters"),
    ('{"id": "x"}', "line 2: give exactly one of text and text_file"),
    ('{"id": "x", "text": "Hi.", "text_file": "t.txt"}', "line 2: give exactly one of text and text_file"),
    ('{"id": "x", "text": "Hi.", "format": "mp4"}', "line 2: format must be one of ['wav', 'flac', 'ogg', 'mp3', 'opus']"),
    ('{"id": "x", "text": "Hi.", "speaker": 16}', "line 2: speaker must be 0..15"),
    ('{"id": "x", "text": "Hi.", "seed": -1}', "line 2: seed must be in [0, 2**63)"),
    ('{"id": "x", "text": "Hi.", "temperature": "hot"}', "line 2: temperature must be a number"),
    ('{"id": "x", "text": "Hi.", "top_p": 2}', "line 2: top_p"),
    ('{"id": "x", "text": "Hi.", "references": [{"audio": "a.wav"}]}', "line 2: references must be a list"),
])
def test_manifest_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "jobs.jsonl"
    path.write_text('{"id": "a", "text": "Hello."}\n' + line + "\n")
    with pytest.raises(ManifestError) as error:
        read_manifest(path)
    assert f"jobs.jsonl {message}" in str(error.value)


def test_the_cli_refuses_a_bad_manifest_before_loading_the_model(tmp_path, monkeypatch, capsys):
    """Before the checkpoint is even looked for (a Hub id would be downloaded): here one that does not exist."""
    (tmp_path / "jobs.jsonl").write_text('{"id": "a", "text": "Hello.", "top_k": 1.5}\n')
    monkeypatch.setattr(cli, "load_model", lambda *args: pytest.fail("the model was loaded"))
    status = cli.main(["--model", str(tmp_path / "missing"), "--manifest", str(tmp_path / "jobs.jsonl"),
                       "--output-dir", str(tmp_path / "o")])
    assert status == 1 and "jobs.jsonl line 1: top_k must be an integer" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, message", [
    (["--manifest", "j.jsonl"], "--manifest needs one output: --output-dir DIR (files) or --output-dataset DIR"),
    (["--output-dir", "o"], "a job reads either --manifest JOBS.jsonl or --dataset SOURCE"),
    (["--manifest", "j.jsonl", "--dataset", "d.parquet", "--output-dir", "o"], "a job reads either"),
    (["--manifest", "j.jsonl", "--output-dir", "o", "Hello."], "leave out TEXT"),
    (["--manifest", "j.jsonl", "--output-dir", "o", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["--manifest", "j.jsonl", "--output-dir", "o", "--text-column", "t"], "--text-column belong to --dataset jobs"),
    (["--dataset", "d.parquet", "--output-dataset", "o", "--column", "voice"], "--column takes FIELD=NAME"),
    (["--dataset", "d.parquet", "--output-dataset", "o", "--column", "colour=c"], "--column takes FIELD=NAME"),
    (["--dataset", "d.parquet", "--output-dataset", "o", "--text-column", "t", "--dialogue-column", "d"],
     "--text-column or --dialogue-column, not both"),
    (["--dataset", "d.parquet", "--output-dir", "o", "--num-shards", "2"], "--num-shards is the number"),
    (["--manifest", "j.jsonl", "--output-dir", __file__], "is a file: give a folder (it is created if missing)"),
    (["--dataset", "d.parquet", "--output-dataset", __file__], f"--output-dataset {__file__!r} is a file"),
])
def test_manifest_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--tiny", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


LAUNCHERS = {  # two processes on the CPU, each with a whole model, started by ...
    # `accelerate launch` (on a CPU machine --multi_gpu is what starts more than one; it starts them with
    # torch.distributed.run's launcher)
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m"],
    # `torchrun` itself (its module form; --standalone: a rendezvous on a free local port)
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_two_ranks_share_a_six_item_job_and_make_the_same_files(job, tmp_path, launcher):
    """`accelerate launch` or `torchrun` with 2 processes: both ranks make items of a 6-item job, the bad item is
    recorded and named, and the files are those of one process byte for byte."""
    manifest, out = job
    six = tmp_path / "six.jsonl"
    lines = manifest.read_text().splitlines()
    six.write_text("\n".join(lines[index] for index in (0, 1, 2, 4, 5, 7)) + "\n")  # one chunk each, one batch
    shutil.copy(manifest.parent / "cut.flac", tmp_path)
    command = [*LAUNCHERS[launcher], "transformers_drama3.cli", *CLI_FLAGS, "--manifest", str(six),
               "--output-dir", str(tmp_path / "out"),
               "--quiet"]  # the default --batch-size 8 would put all 6 items in one batch of one rank
    run = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=environment())
    assert run.returncode == 1 and f"1 item(s) failed ({BAD_ITEM})" in run.stderr, run.stderr
    split = results(tmp_path / "out")
    assert {record["rank"] for record in split.values() if record["status"] == "done"} == {0, 1}
    made = files(tmp_path / "out")
    assert made == {name: data for name, data in files(out).items() if name.split(".")[0] in split}
    assert "cut.flac" in split[BAD_ITEM]["error"]
    moved = {"line": None, "error": None}  # other lines, and the recording's path in another folder
    single = {key: {**value, **moved} for key, value in what_was_made(results(out)).items() if key in split}
    assert {key: {**value, **moved} for key, value in what_was_made(split).items()} == single


def test_every_problem_is_reported_at_once_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """First the lines and missing files (all of them, one message), then, with those fixed, what reading the
    items' files finds: control tokens in text or text files, a voice file that is no voice, a recording that is
    no audio. Neither loads the model."""
    (tmp_path / "notes.txt").write_text("not audio")
    (tmp_path / "tokens.txt").write_text("Read <|im_end|> this.")
    monkeypatch.setattr(cli, "load_model", lambda *args: pytest.fail("the model was loaded"))

    def refused(lines: list[str]) -> str:
        (tmp_path / "jobs.jsonl").write_text("\n".join(['{"id": "a", "text": "Hello."}', *lines]) + "\n")
        status = cli.main(["--model", str(GOLDEN_TINY), "--manifest", str(tmp_path / "jobs.jsonl"),
                           "--output-dir", str(tmp_path / "o")])
        assert status == 1 and not (tmp_path / "o").exists()
        return capsys.readouterr().err

    error = refused(['{not json', '{"id": "b", "text": "Hi.", "colour": 1}', '{"id": "c", "text_file": "gone.txt"}',
                     '{"id": "d", "text": "Hi.", "voice": "gone.voice.safetensors"}',
                     '{"id": "e", "text": "Hi.", "references": [{"audio": "gone.wav", "transcript": "Hi."}]}'])
    assert "5 problems in jobs.jsonl" in error
    for line, problem in [(2, "not valid JSON"), (3, "unknown field(s) ['colour']"), (4, "gone.txt"),
                          (5, "gone.voice.safetensors"), (6, "gone.wav")]:
        assert f"jobs.jsonl line {line}: {problem}" in error or (
            f"jobs.jsonl line {line}: no such file" in error and problem in error)
    error = refused(['{"id": "f", "text": "Say <|im_end|> now."}', '{"id": "g", "text_file": "tokens.txt"}',
                     '{"id": "h", "text": "Hi.", "voice": "notes.txt"}',
                     '{"id": "i", "text": "Hi.", "references": [{"audio": "notes.txt", "transcript": "Hi."}]}'])
    assert "4 problems in the job's items" in error
    for line, item in [(2, "f"), (3, "g"), (4, "h"), (5, "i")]:
        assert f"jobs.jsonl line {line} (id {item}): " in error
    assert error.count("control token '<|im_end|>'") == 2 and "cannot read audio" in error
