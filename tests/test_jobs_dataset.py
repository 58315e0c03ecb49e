"""🤗 datasets in and out (`drama3-tts --dataset ... --output-dataset`, `jobs_dataset.run_dataset`): a parquet file
of texts becomes an audio dataset that `datasets.load_from_disk` reads, whose audio decodes to the samples of the same
rows spoken as a manifest job (an independent path: loose files, no dataset code); a rerun resumes; a row that fails
while running has its error and no audio; parquet shards; every bad row reported at once before the model loads.
The golden tiny checkpoint, 4 frames per row."""

import io
import json

import datasets
import numpy as np
import pytest
import soundfile
import torch

from transformers_drama3 import cli, loading
from transformers_drama3.jobs import run_manifest
from transformers_drama3.jobs_dataset import run_dataset
from transformers_drama3.jobs_items import ManifestError, dataset_items, undecoded
from transformers_drama3.processing_drama3 import Drama3Processor

from .conftest import GOLDEN_TINY
from .test_jobs import write_cut_flac

FRAMES = 4
TEXTS = ["Hello there.", "Good morning to you all.", "Yes.", "What a day it has been, truly.", "No!",
         "Maybe later then."]
FLAGS = ["--model", str(GOLDEN_TINY), "--max-new-tokens", str(FRAMES), "--quiet"]


@pytest.fixture(scope="module")
def model():
    return loading.load_model(str(GOLDEN_TINY), "cpu", torch.float32), Drama3Processor.from_pretrained(GOLDEN_TINY)


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    rows = {"text": TEXTS, "book": [f"book {index % 2}" for index in range(len(TEXTS))]}
    datasets.Dataset.from_dict(rows).to_parquet(str(folder / "texts.parquet"))
    return folder / "texts.parquet"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model):
    """The same rows as a manifest job (ids as the dataset job names rows, so the same seeds): samples per id."""
    folder = tmp_path_factory.mktemp("reference")
    (folder / "jobs.jsonl").write_text("".join(json.dumps({"id": f"row{index}", "text": text}) + "\n"
                                               for index, text in enumerate(TEXTS)))
    run_manifest(*model, folder / "jobs.jsonl", folder / "out", show_progress=False, max_new_tokens=FRAMES)
    return {f"row{index}": soundfile.read(folder / "out" / f"row{index}.wav", dtype="float32")[0]
            for index in range(len(TEXTS))}


def decoded(row: dict) -> np.ndarray:
    """A row's audio decoded from its stored bytes with soundfile (`Audio`'s own decoder needs torchcodec)."""
    samples, rate = soundfile.read(io.BytesIO(row["audio"]["bytes"]), dtype="float32")
    assert rate == 44100
    return samples


def test_a_parquet_file_becomes_an_audio_dataset(parquet, reference, tmp_path):
    status = cli.main([*FLAGS, "--dataset", str(parquet), "--text-column", "text", "--output-dataset",
                       str(tmp_path / "out")])
    assert status == 0
    made = datasets.load_from_disk(str(tmp_path / "out"))
    assert made.column_names == ["text", "book", "audio", "frames", "finish_reason", "seed", "error"]
    assert made.features["audio"] == datasets.Audio(sampling_rate=44100)
    assert made["text"] == TEXTS and made["book"][1] == "book 1" and made["error"] == [None] * len(TEXTS)
    rows = made.cast_column("audio", datasets.Audio(decode=False))
    for index, row in enumerate(rows):
        assert row["audio"]["path"] == f"row{index}.wav" and 0 < row["frames"] <= FRAMES
        np.testing.assert_array_equal(decoded(row), reference[f"row{index}"])  # the same bytes: exactly equal

    again = cli.main([*FLAGS, "--dataset", str(parquet), "--output-dataset", str(tmp_path / "out")])
    records = [json.loads(line) for line in (tmp_path / "out" / "audio" / "results.jsonl").read_text().splitlines()]
    assert again == 0 and len({record["run"] for record in records}) == 1  # nothing made again
    assert datasets.load_from_disk(str(tmp_path / "out"))["seed"] == made["seed"]


def test_a_row_that_fails_has_its_error_and_parquet_shards(model, reference, tmp_path):
    """Row 2 clones a recording that cannot be decoded: its row has the error and no audio, the others are made."""
    write_cut_flac(tmp_path / "cut.flac")
    references = [[] for _ in TEXTS]
    references[2] = [{"audio": "cut.flac", "transcript": "Cut short."}]
    rows = datasets.Dataset.from_dict({"text": TEXTS, "refs": references})
    summary = run_dataset(*model, rows, tmp_path / "out", columns={"text": "text", "references": "refs"},
                          folder=tmp_path, dataset_format="parquet", num_shards=2, show_progress=False,
                          max_new_tokens=FRAMES)
    assert (summary.done, summary.failed, summary.failed_ids) == (5, 1, ["row2"])
    shards = sorted((tmp_path / "out" / "data").iterdir())
    assert [path.name for path in shards] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    made = datasets.load_dataset("parquet", data_dir=str(tmp_path / "out" / "data"), split="train",
                                 cache_dir=str(tmp_path / "cache"))
    assert made.features["audio"] == datasets.Audio(sampling_rate=44100)
    made = made.cast_column("audio", datasets.Audio(decode=False))
    assert made[2]["audio"] is None and "cut.flac" in made[2]["error"] and made[2]["frames"] is None
    for index in (0, 1, 3, 4, 5):
        np.testing.assert_array_equal(decoded(made[index]), reference[f"row{index}"])


def test_every_bad_row_is_reported_at_once_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """The rows' fields (an empty text, a bad seed), the texts read by the processor (a control token) and the
    output's columns: every problem in the first run's one message, before the model loads."""
    rows = {"text": ["Fine.", "Say <|im_end|> now.", "", "Also fine."], "seed": [1, 2, 3, -4],
            "audio": ["a", "b", "c", "d"]}
    datasets.Dataset.from_dict(rows).to_json(str(tmp_path / "rows.jsonl"))
    monkeypatch.setattr(cli, "load_model", lambda *args: pytest.fail("the model was loaded"))
    command = [*FLAGS, "--dataset", str(tmp_path / "rows.jsonl"), "--column", "seed=seed"]
    for output in ("--output-dataset", "--output-dir"):
        assert cli.main([*command, output, str(tmp_path / "out")]) == 1
        error = capsys.readouterr().err
        assert "row 1 (id row1): text contains the control token '<|im_end|>'" in error
        assert "row 2: text is empty" in error and "row 3: seed must be in [0, 2**63), got -4" in error
        clash = "the dataset has column(s) ['audio'], which the audio dataset adds"
        assert (clash in error) == (output == "--output-dataset"), error
        assert f"{3 + (output == '--output-dataset')} problems in {tmp_path / 'rows.jsonl'}" in error
    assert not (tmp_path / "out").exists()


def test_column_mapping_ids_and_dialogues():
    rows = datasets.Dataset.from_dict({"key": ["a", "b"], "turns": [
        [{"speaker": 0, "text": "Hi."}, {"speaker": 1, "text": "Hello."}], [{"speaker": 2, "text": "Bye."}]],
        "temp": [0.5, None]})
    items = dataset_items(rows, {"id": "key", "temperature": "temp"}, dialogue_column="turns")
    assert [item.id for item in items] == ["a", "b"]
    assert items[0].text == "<|speaker:0|> Hi. <|speaker:1|> Hello." and items[1].text == "<|speaker:2|> Bye."
    assert items[0].settings == {"temperature": 0.5} and items[1].settings == {}
    with pytest.raises(ManifestError, match=r"(?s)2 problems in the dataset.*'colour' is not an item field.*no column 'missing'"):
        dataset_items(rows, {"text": "missing", "colour": "key"})
    bad = datasets.Dataset.from_dict({"turns": [[{"speaker": 99, "text": "Hi."}]]})
    with pytest.raises(ManifestError, match=r"row 0: turns: a dialogue is a non-empty list"):
        dataset_items(bad, dialogue_column="turns")


def test_the_ray_stages_without_ray(reference, tmp_path):
    """`ReferenceEncoder` then `Drama3Predictor` called on pyarrow tables as Ray's actors call them (no Ray needed):
    the plain job's samples for the same ids; a recording that cannot be decoded fails in the CPU stage, and the row
    keeps its error; rows whose fingerprint is done are left out; rows that skipped the CPU stage are refused."""
    import pyarrow as pa

    from transformers_drama3.jobs_ray import Drama3Predictor, ReferenceEncoder

    write_cut_flac(tmp_path / "cut.flac")
    references = [[] for _ in TEXTS]
    references[2] = [{"audio": "cut.flac", "transcript": "Cut short."}]
    table = pa.table({"key": [f"row{index}" for index in range(len(TEXTS))], "text": TEXTS, "refs": references})
    settings = {"columns": {"id": "key", "text": "text", "references": "refs"}, "folder": str(tmp_path),
                "max_new_tokens": FRAMES}
    coded = ReferenceEncoder(str(GOLDEN_TINY), **settings)(table)
    assert coded["error"][2].as_py().startswith("id row2: ") and "cut.flac" in coded["error"][2].as_py()
    predictor = Drama3Predictor(str(GOLDEN_TINY), device="cpu", batch_size=4, **settings)
    made = predictor(coded).to_pylist()
    assert [row["key"] for row in made] == table["key"].to_pylist() and "reference_codes" not in made[0]
    assert made[2]["audio"] is None and made[2]["error"] == coded["error"][2].as_py()
    for index in (0, 1, 3, 4, 5):
        assert made[index]["error"] is None and made[index]["fingerprint"] == coded["fingerprint"][index].as_py()
        np.testing.assert_array_equal(decoded(made[index]), reference[f"row{index}"])  # the same bytes
    again = ReferenceEncoder(str(GOLDEN_TINY), done={made[0]["fingerprint"], made[1]["fingerprint"]}, **settings)
    assert again(table)["key"].to_pylist() == ["row2", "row3", "row4", "row5"]
    with pytest.raises(ValueError, match="Drama3Predictor takes the rows ReferenceEncoder made"):
        predictor(table)


def test_an_audio_column_gives_each_row_its_reference(model, tmp_path):
    """A reference audio column (`datasets.Audio`: row 1's file stored in the dataset as bytes, row 3's by its path)
    and a transcript column: each row is cloned from its recording, decoded with soundfile (torchcodec is not
    needed), with the same audio as the manifest job that names the file. The Python API takes the column's
    values as references too."""
    rng = np.random.default_rng(3)
    soundfile.write(tmp_path / "voice.wav", rng.uniform(-0.3, 0.3, 22050).astype(np.float32), 44100)
    stored = {"bytes": (tmp_path / "voice.wav").read_bytes(), "path": "voice.wav"}
    refs = [None, stored, None, {"bytes": None, "path": str(tmp_path / "voice.wav")}]
    rows = datasets.Dataset.from_dict({"text": TEXTS[:4], "ref": refs,
                                       "ref_text": [None, "A voice.", None, "A voice."]})
    rows = rows.cast_column("ref", datasets.Audio())
    columns = {"text": "text", "reference_audio": "ref", "reference_transcript": "ref_text"}
    summary = run_dataset(*model, rows, tmp_path / "out", columns=columns, show_progress=False,
                          max_new_tokens=FRAMES)
    assert (summary.done, summary.failed) == (4, 0)
    made = datasets.load_from_disk(str(tmp_path / "out"))
    assert made.features["ref"] == datasets.Audio() and made["ref_text"] == rows["ref_text"]  # the input's columns
    made = undecoded(made)

    (tmp_path / "jobs.jsonl").write_text("".join(json.dumps(
        {"id": f"row{index}", "text": text,
         **({"references": [{"audio": "voice.wav", "transcript": "A voice."}]} if index in (1, 3) else {})}) + "\n"
        for index, text in enumerate(TEXTS[:4])))
    run_manifest(*model, tmp_path / "jobs.jsonl", tmp_path / "plain", show_progress=False, max_new_tokens=FRAMES)
    for index, row in enumerate(made):
        assert row["audio"]["bytes"] == (tmp_path / "plain" / f"row{index}.wav").read_bytes(), index

    processor = model[1].with_codec(model[0].codec)
    from_file = processor.encode_audio(str(tmp_path / "voice.wav"))
    samples, rate = soundfile.read(tmp_path / "voice.wav", dtype="float32")
    for value in (stored, {"bytes": None, "path": str(tmp_path / "voice.wav")},
                  {"array": samples, "sampling_rate": rate, "path": None}):
        assert torch.equal(processor.encode_audio(value), from_file)  # the same samples, the same codes
    inputs = processor("Hello.", references={"audio": stored, "transcript": "A voice."})
    assert torch.equal(inputs["input_ids"], processor("Hello.", references={
        "audio": str(tmp_path / "voice.wav"), "transcript": "A voice."})["input_ids"])

    class AudioDecoder:  # what datasets >= 4 hands out for a decoded audio column (torchcodec's decoder)
        pass

    with pytest.raises(TypeError, match=r"Audio\(decode=False\)"):
        processor.check_audio(AudioDecoder(), where="references[0]")
