"""Tensor and expert parallelism under torchrun (2 CPU processes, gloo) against one process, and the launches that
must be refused (in process: the checks run before any process group or weight)."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import soundfile
import torch

from transformers_drama3 import FishOmniConfig, FishOmniForSpeech, cli, compat, parallel
from transformers_drama3.parallel import Drama3ParallelError
from transformers_drama3.quantization_bsgemm import FP8_EXPERT_WEIGHTS, BsgemmMoeConfig, BsgemmMoeHfQuantizer
from transformers_drama3.testing import write_tiny_checkpoint

from .conftest import GOLDEN_TINY
from .parallel_worker import prompt_rows, run_outputs

RANKS = 2
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
WORKER = Path(__file__).parent / "parallel_worker.py"
REPO = Path(__file__).parent.parent
TIMEOUT = 600


def torchrun(*args: str, cwd=None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    environment.pop("WORLD_SIZE", None)
    result = subprocess.run([*TORCHRUN, *args], capture_output=True, text=True, timeout=TIMEOUT, env=environment, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny FP8 checkpoint that both modes can split over 2 ranks: 2 key/value heads (the attention is split) and
    256 expert rows (a 128-row FP8 scale block per rank under tensor parallelism)."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("parallel") / "tiny", text_config={"num_key_value_heads": 2, "moe_intermediate_size": 256},
        audio_decoder_config={"n_local_heads": 2},
    )


@pytest.fixture(scope="module")
def single(checkpoint):
    """The single-process model and its outputs (the reference)."""
    torch.manual_seed(0)
    model = FishOmniForSpeech.from_pretrained(checkpoint, dtype=torch.float32)
    return model, run_outputs(model)


@pytest.fixture(scope="module")
def ranks(checkpoint, tmp_path_factory):
    """`{mode: [rank 0 outputs, rank 1 outputs]}` of one torchrun launch of the worker in both modes."""
    output_dir = tmp_path_factory.mktemp("parallel-out")
    torchrun(str(WORKER), str(checkpoint), str(output_dir), "tensor", "expert")
    return {mode: [torch.load(output_dir / f"{mode}-rank{r}.pt") for r in range(RANKS)] for mode in ("tensor", "expert")}


def tolerance(config, depth: int, reference: torch.Tensor) -> float:
    """Allowed |split - single| of float32 outputs `depth` layers deep.

    Splitting a layer changes only the order of its float32 sums (partial sums per rank, then an all-reduce). A sum of
    K terms rounds by about sqrt(K) * eps relative to its magnitude (random-walk rounding), K at most the widest
    contraction of the model; each layer adds its own rounding and the residual stream and RMSNorm carry earlier
    ones on about unchanged, so errors add over the depth; a factor 4 covers the amplification of norms and
    softmaxes. Scaled by the largest magnitude of the reference output.
    """
    text, tower = config.text_config, config.audio_decoder_config
    widest = max(text.hidden_size, text.moe_intermediate_size, text.shared_expert_intermediate_size,
                 text.num_attention_heads * text.head_dim, tower.intermediate_size)
    return 4 * depth * math.sqrt(widest) * torch.finfo(torch.float32).eps * reference.abs().max().item()


def depths(config) -> dict[str, int]:
    """Layers each output is computed through: backbone layers, then lm_head (main) or the tower (codebooks)."""
    backbone = config.text_config.num_hidden_layers
    tower = config.audio_decoder_config.shared_enrichment_layers + config.audio_decoder_config.n_layer
    return {"last_hidden_state": backbone, "main_logits": backbone + 1, "codebook_logits": backbone + tower}


@pytest.mark.parametrize("mode", ["tensor", "expert"])
def test_split_outputs_match_one_process(mode, ranks, single):
    model, reference = single
    for name, depth in depths(model.config).items():
        allowed = tolerance(model.config, depth, reference[name])
        for rank in ranks[mode]:
            assert (rank[name] - reference[name]).abs().max().item() <= allowed, name
        assert torch.equal(ranks[mode][0][name], ranks[mode][1][name]), f"{name} differs between ranks"


def test_greedy_decisions_are_wider_than_the_split_rounding(single):
    """Every greedy choice of the reference frames wins by more than twice the rounding a split may add to its logits
    (the tolerance above), so the split runs must make the same choices: the equality below is implied, not luck."""
    model, reference = single
    prompt = prompt_rows(model.config)
    codes = reference["greedy"]  # [NCB, n]
    rows = torch.cat(((codes[:1] + model.config.semantic_start_token_id), codes)).T[None]  # [1, n, 1 + NCB]
    with torch.no_grad():
        out = model(torch.cat((prompt, rows), dim=1))
    first = prompt.shape[1]
    main = out.main_logits[0, first - 1 : -1]  # [n, V + 1]: the logits each generated main token was chosen from
    books = out.codebook_logits[0, first:]  # [n, NCB - 1, V]
    for logits, name in ((main, "main_logits"), (books, "codebook_logits")):
        top = logits.topk(2, dim=-1).values
        margin = (top[..., 0] - top[..., 1]).min().item()
        assert margin > 2 * tolerance(model.config, depths(model.config)[name], reference[name]), name


@pytest.mark.parametrize("mode", ["tensor", "expert"])
@pytest.mark.parametrize("run", ["greedy", "sampled"])
def test_split_generation_gives_the_frames_of_one_process_on_every_rank(mode, run, ranks, single):
    """Greedy: implied by the margins above. Sampled (seeded): the same noise on every rank and in one process, and
    no draw of these frames falls within the split's rounding of a tie."""
    _, reference = single
    for rank in ranks[mode]:
        assert torch.equal(rank[run], reference[run])


@pytest.mark.parametrize("mode", ["tensor", "expert"])
def test_split_generation_streams_its_frames(mode, ranks, single):
    _, reference = single
    for rank in ranks[mode]:
        assert torch.equal(rank["streamed"], reference["greedy"])


@pytest.mark.parametrize("mode", ["tensor", "expert"])
def test_unseeded_sampling_agrees_between_ranks(mode, ranks):
    """Without a seed, rank 0 draws one for all ranks (`model.split_rules.shared_seed`), whatever each rank's global
    generator holds (the worker seeds them differently)."""
    assert torch.equal(ranks[mode][0]["unseeded"], ranks[mode][1]["unseeded"])


@pytest.mark.parametrize("mode", ["tensor", "expert"])
def test_parameters_are_split_as_is_split_says(mode, ranks, single):
    """The shards transformers made are the ones the memory table counts; attention, experts and the embedding (on
    newer transformers) are split, lm_head, the tower and the codec are not."""
    model, _ = single
    expert = mode == "expert"
    for rank in ranks[mode]:
        for name, parameter in model.named_parameters():
            divisor = RANKS if parallel.is_split(name, model.config, RANKS, expert) else 1
            assert rank["local_numel"][name] == parameter.numel() // divisor, name
    split = [name for name in ranks[mode][0]["local_numel"] if parallel.is_split(name, model.config, RANKS, expert)]
    experts_split = expert or compat.tensor_plan_splits_experts(model.config.text_config)  # newer: EP splits experts
    assert any(".experts." in name for name in split) == experts_split
    attention_split = any(".self_attn.q_proj" in name for name in split)
    assert attention_split == (not expert or compat.expert_parallel_by_size())  # 5.17's expert plan: dense whole
    assert not any(name.startswith(("lm_head", "tower", "codec")) for name in split)


@pytest.mark.parametrize("mode", ["tensor", "expert"])
def test_refusals_on_a_split_model(mode, ranks):
    for rank in ranks[mode]:
        assert "fast_decode=True is not supported" in rank["fast_decode_error"]
        assert "every rank must use the same seed" in rank["seed_error"]


def test_cli_under_torchrun_writes_the_single_process_wav(tmp_path):
    """The issue's command: one WAV, from rank 0, equal to a single-process run; default tiny checkpoint (1 key/value
    head, so the attention stays whole on both ranks; 128 FP8 expert rows, so expert parallelism)."""
    command = ["--tiny", "Hello", "--max-new-tokens", "8", "--seed", "0", "--quiet"]
    single = subprocess.run([sys.executable, "-m", "transformers_drama3.cli", *command, "-o", str(tmp_path / "one.wav")],
                            capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert single.returncode == 0, single.stderr
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    torchrun("-m", "transformers_drama3.cli", *command, "-o", "x.wav", cwd=split_dir)
    assert os.listdir(split_dir) == ["x.wav"]
    assert (split_dir / "x.wav").read_bytes() == (tmp_path / "one.wav").read_bytes()
    assert soundfile.info(str(split_dir / "x.wav")).frames > 0


def test_parallel_check_script_runs_on_cpu(tmp_path):
    """benchmarks/parallel_check.py, the GPU check, on 2 CPU processes with the tiny geometry."""
    report = tmp_path / "report.json"
    result = torchrun(str(REPO / "benchmarks" / "parallel_check.py"), "--config", "tiny", "--frames", "3",
                      "--warmup", "1", "--checkpoint", str(tmp_path / "ckpt"), "--output", str(report))
    assert "greedy frames equal to one process" in result.stdout
    modes = json.loads(report.read_text())["modes"]
    assert sorted(modes) == ["expert", "tensor"]
    for result in modes.values():
        assert result["leading_equal_frames"] == result["frames"] == 4  # warmup + timed


# -- refused before anything is loaded (no process group is ever created here) ---------------------------------------


@pytest.fixture
def two_ranks(monkeypatch):
    """This process looks like one of 2 torchrun ranks (the checks read WORLD_SIZE; nothing connects)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")


def golden_config(**text) -> FishOmniConfig:
    config = FishOmniConfig.from_pretrained(GOLDEN_TINY)
    for key, value in text.items():
        setattr(config.text_config, key, value)
    return config


def test_no_process_group_is_refused(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(Drama3ParallelError, match="launch it with `torchrun --nproc-per-node N"):
        FishOmniForSpeech.from_pretrained(GOLDEN_TINY, tp_plan="auto")


def test_device_map_with_a_plan_is_refused(two_ranks):
    with pytest.raises(Drama3ParallelError, match="`device_map` are exclusive"):
        FishOmniForSpeech.from_pretrained(GOLDEN_TINY, tp_plan="auto", device_map="cpu")


def test_a_tp_size_other_than_the_world_size_is_refused(two_ranks):
    with pytest.raises(Drama3ParallelError, match="tp_size=4 but torchrun started 2 processes"):
        FishOmniForSpeech.from_pretrained(GOLDEN_TINY, tp_plan="auto", tp_size=4)


def test_other_parallelisms_are_refused(two_ranks):
    with pytest.raises(Drama3ParallelError, match="tensor and expert parallelism only"):
        FishOmniForSpeech.from_pretrained(GOLDEN_TINY, distributed_config={"fsdp_size": 2})


def test_experts_that_the_ranks_do_not_divide_are_refused(two_ranks):
    config = golden_config(num_experts=3)
    with pytest.raises(Drama3ParallelError, match="routed experts divisible by 2, but the model has 3"):
        FishOmniForSpeech.from_pretrained(GOLDEN_TINY, config=config,
                                          distributed_config=parallel.distributed_config(expert_parallel=True))


def test_expert_rows_that_the_ranks_do_not_divide_are_refused(two_ranks):
    """Where transformers' tensor plan cuts every expert's rows; where it keeps experts whole (newer versions)
    there is nothing to divide, and the check lets the load go on."""
    config = golden_config(moe_intermediate_size=129)
    if not compat.tensor_plan_splits_experts(config.text_config):
        parallel.ParallelRequest(size=2, expert_parallel=False, tp_plan=None).check(config)
        return
    with pytest.raises(Drama3ParallelError, match="moe_intermediate_size = 129, which 2 does not divide"):
        FishOmniForSpeech.from_pretrained(GOLDEN_TINY, config=config, tp_plan="auto")


def test_fp8_blocks_cut_by_tensor_parallelism_are_refused(two_ranks):
    """The golden checkpoint's 128 FP8 expert rows would give each of 2 ranks half a scale block, where the tensor
    plan cuts expert rows; a plan that keeps experts whole (newer transformers) cuts no block."""
    config = FishOmniConfig.from_pretrained(GOLDEN_TINY)
    if not compat.tensor_plan_splits_experts(config.text_config):
        parallel.ParallelRequest(size=2, expert_parallel=False, tp_plan=None).check(config)
        return
    with pytest.raises(Drama3ParallelError, match="2 ranks would get 64. Use expert parallelism"):
        FishOmniForSpeech.from_pretrained(GOLDEN_TINY, tp_plan="auto")


def test_a_plan_that_splits_attention_heads_the_ranks_do_not_divide_is_refused(two_ranks):
    """The golden checkpoint has 1 key/value head; `tp_plan="auto"` keeps attention whole, a plan of one's own that
    splits it is refused."""
    plan = parallel.tensor_parallel_plan(FishOmniConfig().text_config, 2)  # the real model's plan splits attention
    with pytest.raises(Drama3ParallelError, match="do not divide the 1 key/value heads"):
        FishOmniForSpeech.from_pretrained(GOLDEN_TINY, config=golden_config(moe_intermediate_size=256), tp_plan=plan)


def test_auto_plan_keeps_attention_whole_when_the_ranks_outnumber_the_heads(two_ranks):
    config = golden_config()
    assert not parallel.attention_is_split(config.text_config, 2)
    assert not any(".self_attn." in key for key in parallel.tensor_parallel_plan(config.text_config, 2))
    assert parallel.attention_is_split(FishOmniConfig().text_config, 2)
    assert not parallel.attention_is_split(FishOmniConfig().text_config, 4)


def test_fp8_block_scales_get_the_rules_of_their_weights_where_transformers_does_not_add_them(two_ranks):
    """transformers 5.17 splits FP8 experts kept as shipped but not their `_scale_inv` block scales: the quantizer
    (for the model's plans) and `ParallelRequest` (for a plan of one's own, which is the whole plan there) add the
    scale rules; newer versions add them themselves, where none are added."""
    config = golden_config(moe_intermediate_size=256)
    plan = parallel.tensor_parallel_plan(config.text_config, 2)
    added = {f"{key}_scale_inv": style for key, style in plan.items() if key.endswith(("experts.gate_up_proj",
                                                                                    "experts.down_proj"))}
    # Newer versions keep routed experts whole in the tensor plan: no expert weight, so no scale, is split.
    splits_experts = compat.tensor_plan_splits_experts(config.text_config)
    assert set(added.values()) == ({"packed_colwise", "rowwise"} if splits_experts else set())
    expected = {} if compat.quantizers_split_scales_with_their_weights() else added
    assert compat.scale_rules(plan, FP8_EXPERT_WEIGHTS) == expected
    def scales(rules: dict[str, str]) -> dict[str, str]:
        return {key: style for key, style in rules.items() if key.endswith("_scale_inv")}

    own_plan = parallel.ParallelRequest(size=2, expert_parallel=False, tp_plan=plan).load_kwargs(config)
    assert scales(own_plan["distributed_config"].tp_plan) == expected
    dequantised = parallel.ParallelRequest(size=2, expert_parallel=False, tp_plan=plan, dequantize=True)
    assert scales(dequantised.load_kwargs(config)["distributed_config"].tp_plan) == {}  # no scales to split
    text = copy.deepcopy(config).text_config
    quantizer = BsgemmMoeHfQuantizer(BsgemmMoeConfig(), pre_quantized=True)
    if not compat.quantizers_split_scales_with_their_weights():  # 5.17 asks the quantizer for the model's plans
        quantizer.update_tp_plan(SimpleNamespace(text_config=text, base_model_tp_plan=None,
                                                 base_model_ep_plan=None))
    model_rules = {key.removeprefix(parallel.BACKBONE_PREFIX): style for key, style in expected.items()}
    assert scales(text.base_model_tp_plan) == model_rules


def test_cli_parallel_flag_needs_torchrun(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--tiny", "Hi.", "-o", "x.wav", "--parallel", "tensor"])
    assert exit_.value.code == 2 and "torchrun --nproc-per-node N" in capsys.readouterr().err


def test_cli_device_is_per_rank_under_torchrun(two_ranks, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--tiny", "Hi.", "-o", "x.wav", "--device", "cpu"])
    assert exit_.value.code == 2 and "leave --device out" in capsys.readouterr().err


def test_run_on_main_process_is_a_plain_call_in_one_process():
    assert parallel.run_on_main_process(lambda a, b=0: a + b, 1, b=2) == 3
