"""`specmesh`'s command line: every subcommand's --help lists all its options, each with a help string; a bad option
or model is one line on stderr and exit status 2; --max-model-len defaults to the model's context length."""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from services import cli, engine_flags, launcher
from services.gateway import seed_option, service as gateway_service
from services.gateway.auth import API_KEY_ENV, VLLM_API_KEY_ENV
from services.startup_checks import MODEL_CONFIG_FILE
from shared.config import DEFAULT_MODEL_DIR
from shared.nats_credentials import MeshCredentials
from shared.nats_roles import NatsRole
from shared.ports import free_port
from shared.tokenizer import TOKENIZER_FILE

DEMO_CONTEXT = json.loads((DEFAULT_MODEL_DIR / MODEL_CONFIG_FILE).read_text())["max_position_embeddings"]


def _options(command: str) -> list[str]:
    parser = cli.command_parser(command, importlib.import_module(cli.COMMANDS[command]))
    return [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_help_lists_every_option_of_the_command_with_its_help(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    parser = cli.command_parser(command, importlib.import_module(cli.COMMANDS[command]))
    assert [a.option_strings for a in parser._actions if not a.help] == []
    missing = [flag for flag in _options(command) if flag not in shown]
    assert missing == [] and "--log-level" in shown


def test_the_installed_entry_point_shows_a_commands_options() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert all(flag in shown for flag in ("--max-model-len", "--api-key", "--max-restarts", "--nats-port"))


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.parse(argv)
    assert exit_info.value.code == cli.USAGE_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def unsupported_model(tmp_path: Path) -> Path:
    shutil.copy(DEFAULT_MODEL_DIR / TOKENIZER_FILE, tmp_path / TOKENIZER_FILE)
    config = json.loads((DEFAULT_MODEL_DIR / MODEL_CONFIG_FILE).read_text()) | {"architectures": ["MambaForCausalLM"]}
    (tmp_path / MODEL_CONFIG_FILE).write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "argv, named",
    [
        (["up", "--bogus"], "unrecognized arguments: --bogus"),
        (["up", "--port", "eighty"], "--port"),
        (["up", "--model", "/no/such/model"], "--model /no/such/model: no such directory"),
        (["gateway", "--model", "/no/such/model"], "--model /no/such/model"),
        (["worker", "--model", str(DEFAULT_MODEL_DIR.parent)], f"no {MODEL_CONFIG_FILE}"),
        (["up", "--speculative-config", "{not json"], "--speculative-config: not valid JSON"),
        (["worker", "--speculative-config", '{"method": "eagle"}'], "--speculative-config: method"),
        (["up", "--max-model-len", str(DEMO_CONTEXT * 2)], f"--max-model-len {DEMO_CONTEXT * 2} exceeds"),
        (["gateway", "--max-model-len", str(DEMO_CONTEXT + 1)], "max_position_embeddings"),
        (["gateway", "--max-n", "100000"], "argument --max-n: must be between 1 and 256, got 100000"),
        # Refused by up itself, before the rest of the mesh starts, not by the gateway it would start last
        (["up", "--max-n", "300"], "argument --max-n: must be between 1 and 256, got 300"),
        (["up", "--device", "gpu"], "--device: must be cpu, cuda or cuda:N, got 'gpu'"),
        (["up", "-tp", "2", "--device", "cuda:1"], "rank r runs on cuda:r: give device cuda, not 'cuda:1'"),
        # vLLM's share of a GPU's memory: read on CUDA alone, and not beside an explicit KV budget
        (["up", "--gpu-memory-utilization", "0.5"], "gpu_memory_utilization (0.5) sizes the default KV budget on CUDA"),
        (["worker", "--device", "cuda", "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1GiB"],
         "beside kv_cache_memory, nothing reads it"),
        (["up", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: must be more than 0 and at most 1"),
        (["up", "--no-chunked-prefill", "--max-num-batched-tokens", "2048"],
         "max_num_batched_tokens (2048) bounds the pieces of chunked prefill"),
        # A --speculative-config key the method never reads is refused by name, not ignored
        (["up", "--speculative-config", '{"method": "ngram", "suffix_decoding_max_tree_depth": 64}'],
         'suffix_decoding_max_tree_depth (64) is not read by method "ngram"'),
        (["worker", "--speculative-config", '{"method": "naive", "num_speculative_tokens": 5}'],
         'num_speculative_tokens (5) is not read by method "naive"'),
        (["up", "--speculative-config", '{"method": "mtp", "min_ngram_size": 1}'],
         'min_ngram_size (1) is not read by method "mtp"'),
        (["up", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0, "max_ngram_size": 3}'],
         "max_ngram_size (3) is not read with num_speculative_tokens 0"),
        # Numeric options out of range: one line naming the option, not a traceback or a mesh half started.
        (["up", "--max-num-seqs", "0"], "argument --max-num-seqs: must be at least 1, got 0"),
        (["up", "--max-model-len", "8"], "--max-model-len: Input should be greater than or equal to 16"),
        (["up", "--port", "70000"], "argument --port: must be a port between 1 and 65535"),
        (["up", "--detokenizers", "0"], "argument --detokenizers: must be at least 1"),
        (["up", "--queue-max-msgs", "0"], "argument --queue-max-msgs: must be at least 1"),
        (["up", "--max-n", "0"], "argument --max-n: must be between 1 and 256, got 0"),
        (["worker", "--block-size", "0"], "argument --block-size: must be at least 1"),
        (["gateway", "--request-timeout", "0"], "argument --request-timeout: must be more than 0 seconds"),
        # Each take-over is a redelivery of the work queue's message, which JetStream makes 5 times at most.
        (["up", "--max-migrations", "4"], "--max-migrations: must be between 0 and 3"),
        (["detokenizer", "--max-migrations", "10"], "--max-migrations: must be between 0 and 3"),
        (["nopes"], "invalid choice: 'nopes'"),
        # A role's own split is for disaggregated workers; every size must split the model
        (["up", "--prefill-tensor-parallel-size", "2"], "--prefill-tensor-parallel-size split disaggregated"),
        (["up", "--prefill-workers", "1", "--decode-workers", "1", "--decode-tensor-parallel-size", "3"],
         "--tensor-parallel-size 3"),
        (["up", "--decode-tensor-parallel-size", "0"], "argument --decode-tensor-parallel-size: must be from 1"),
    ],
)
def test_a_bad_option_or_model_is_one_line_and_exit_status_2(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert named in _refused(argv, capsys)


@pytest.mark.parametrize("option", ["--port", "--nats-port"])
def test_a_port_another_program_listens_on_is_refused_before_anything_starts(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Else the start-up probe, API key included, would reach that program, and report the mesh up."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        port = squatter.getsockname()[1]
        assert f"{option} {port}: " in _refused(["up", option, str(port)], capsys)


def test_an_unsupported_model_is_refused_by_name(unsupported_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("up", "worker"):
        assert "unsupported architecture ['MambaForCausalLM']" in _refused([command, "--model", str(unsupported_model)], capsys)


def test_weights_that_are_not_safetensors_are_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Git LFS pointer where the weights should be (a clone without LFS): whether the checkpoint stores a head of
    its own is read from the weight files' headers, so the refusal names the file rather than a traceback."""
    shutil.copy(DEFAULT_MODEL_DIR / TOKENIZER_FILE, tmp_path / TOKENIZER_FILE)
    config = json.loads((DEFAULT_MODEL_DIR / MODEL_CONFIG_FILE).read_text()) | {"tie_word_embeddings": True}
    (tmp_path / MODEL_CONFIG_FILE).write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n")
    for command in ("up", "worker"):
        assert "model.safetensors cannot be read as safetensors" in _refused([command, "--model", str(tmp_path)], capsys)


def test_a_refusal_from_the_real_process_is_one_line_without_traceback(tmp_path: Path) -> None:
    for argv in (["up", "--bogus"], ["up", "--model", str(tmp_path)]):
        done = subprocess.run([sys.executable, "-m", "services.cli", *argv], capture_output=True, text=True)
        assert done.returncode == cli.USAGE_ERROR
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("specmesh up: error:"), done.stderr


@pytest.mark.parametrize("command", ["up", "worker", "gateway"])
def test_max_model_len_defaults_to_the_models_context_length(command: str) -> None:
    # up checks that its ports are free: ports of its own, whatever listens on the defaults on this machine.
    ports = ["--port", str(free_port()), "--nats-port", str(free_port())] if command == "up" else []
    _, args = cli.parse([command, "--model", str(DEFAULT_MODEL_DIR), *ports])
    assert args.max_model_len == DEMO_CONTEXT
    _, args = cli.parse([command, "--model", str(DEFAULT_MODEL_DIR), "--max-model-len", "256", *ports])
    assert args.max_model_len == 256


def test_dtype_auto_is_float32_on_the_cpu_and_the_checkpoints_own_on_cuda(tmp_path: Path) -> None:
    """up takes --dtype and hands it to its workers as given; each resolves auto against its device and checkpoint."""
    ports = ["--port", str(free_port()), "--nats-port", str(free_port())]
    _, args = cli.parse(["up", "--dtype", "bfloat16", *ports])
    assert engine_flags.forwarded(args)[:2] == ["--dtype", "bfloat16"]
    assert engine_flags.config_keys(args)["dtype"] == "bfloat16"
    _, args = cli.parse(["worker"])
    assert args.dtype == engine_flags.AUTO_DTYPE and engine_flags.config_keys(args)["dtype"] == "float32"
    published = tmp_path / "published"
    published.mkdir()
    config = json.loads((DEFAULT_MODEL_DIR / MODEL_CONFIG_FILE).read_text())
    for stored, on_cuda in (({"torch_dtype": "bfloat16"}, "bfloat16"), ({"dtype": "float16"}, "float16"),
                            ({"text_config": {"torch_dtype": "bfloat16"}}, "bfloat16"), ({}, "float32")):
        fields = {k: v for k, v in config.items() if k not in engine_flags.CHECKPOINT_DTYPE_KEYS} | stored
        (published / MODEL_CONFIG_FILE).write_text(json.dumps(fields))
        assert engine_flags.resolved_dtype("auto", "cuda", published) == on_cuda
        assert engine_flags.resolved_dtype("auto", "cpu", published) == "float32"
        assert engine_flags.resolved_dtype("float16", "cpu", published) == "float16"


def test_gpu_memory_utilization_reaches_a_cuda_workers_engine_config() -> None:
    ports = ["--port", str(free_port()), "--nats-port", str(free_port())]
    _, args = cli.parse(["up", "--device", "cuda", "--gpu-memory-utilization", "0.75", *ports], resolve=False)
    assert engine_flags.config_keys(args)["gpu_memory_utilization"] == 0.75
    forwarded = engine_flags.forwarded(args)
    assert forwarded[forwarded.index("--gpu-memory-utilization") + 1] == "0.75"


def test_seed_reaches_the_gateways_config_through_up() -> None:
    ports = ["--port", str(free_port()), "--nats-port", str(free_port())]
    _, args = cli.parse(["up", "--seed", "1234", *ports])
    forwarded = seed_option.forwarded(args)
    assert forwarded == ["--seed", "1234"]
    _, args = cli.parse(["gateway", *forwarded])
    assert gateway_service.config_from_args(args).seed == 1234
    _, args = cli.parse(["gateway"])
    assert gateway_service.config_from_args(args).seed is None


@pytest.mark.parametrize("command", ["up", "gateway"])
def test_a_vllm_tool_calling_command_line_is_taken_as_is(command: str) -> None:
    ports = ["--port", str(free_port()), "--nats-port", str(free_port())] if command == "up" else []
    _, args = cli.parse([command, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", *ports])
    assert args.tool_call_parser == "hermes"


def test_log_level_is_taken_before_or_after_the_command() -> None:
    assert cli.parse(["--log-level", "debug", "detokenizer"])[1].log_level == "DEBUG"
    assert cli.parse(["detokenizer", "--log-level", "warning"])[1].log_level == "WARNING"
    assert cli.parse(["detokenizer"])[1].log_level == cli.DEFAULT_LOG_LEVEL


def test_the_api_keys_go_to_the_gateway_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys the launcher was started with (its environment) are not inherited by the workers and detokenizers; the
    launcher hands the gateway its keys itself."""
    monkeypatch.setenv(API_KEY_ENV, "sk-secret")
    monkeypatch.setenv(VLLM_API_KEY_ENV, "sk-vllm-secret")
    credentials = MeshCredentials.generate()
    for role in (NatsRole.WORKER, NatsRole.DETOKENIZER, NatsRole.GATEWAY):
        _, env = launcher._child_nats(argparse.Namespace(), "nats://127.0.0.1:4222", credentials, role)
        assert not {API_KEY_ENV, VLLM_API_KEY_ENV} & env.keys()
        assert not {"sk-secret", "sk-vllm-secret"} & set(env.values())


@pytest.mark.parametrize(
    "host, loopback",
    [("127.0.0.1", True), ("::1", True), ("localhost", True), ("0.0.0.0", False), ("::", False),
     ("10.0.0.5", False), ("gateway.example", False)],
)
def test_a_gateway_reachable_from_elsewhere_is_told_apart(host: str, loopback: bool) -> None:
    """What decides the warning a gateway logs when it listens beyond this machine with no API key."""
    assert gateway_service._loopback(host) is loopback
