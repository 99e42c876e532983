"""``vllm serve`` as a child process (kvstrata.integrations.vllm.server): its command line, and a
server that cannot start failing in one error with its log, leaving no process behind."""

from __future__ import annotations

import json

import pytest

from tests.process_support import children_running

from kvstrata.integrations.vllm.server import ServerFailed, ServerSpec, VllmServer, start_together


def test_the_command_line_is_vllms_server_with_the_connector():
    spec = ServerSpec("/models/m", kv_blocks=40, block_size=32, max_model_len=1024, connector={"host_bytes": 1 << 26})
    argv = spec.argv(8123)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(argv[3::2], argv[4::2]))  # flag, value pairs (up to the first bare flag)
    assert (flags["--model"], flags["--port"], flags["--host"]) == ("/models/m", "8123", "127.0.0.1")
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "40"
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "KVStrataConnector" and transfer["kv_role"] == "kv_both"
    assert transfer["kv_connector_extra_config"] == {"host_bytes": 1 << 26}
    assert "--enable-prefix-caching" in argv
    # vLLM's default stop kills its workers at once: a connector server is given time to close its caches
    assert int(argv[argv.index("--shutdown-timeout") + 1]) > 0
    plain = ServerSpec("/models/m", prefix_caching=False).argv(1)
    assert "--kv-transfer-config" not in plain and "--no-enable-prefix-caching" in plain


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"kv_blocks": 32, "block_size": 32, "max_model_len": 1024},
         "32 KV blocks of 32 tokens, less vLLM's null block, hold fewer than one request"),
        ({"kv_role": "producer"}, "kv_role must be kv_both, kv_producer or kv_consumer, got 'producer'"),
    ],
)
def test_a_configuration_vllm_would_refuse_is_one_line(kwargs, named):
    with pytest.raises(ValueError, match=named) as info:
        ServerSpec("/models/m", **kwargs)
    assert "\n" not in str(info.value)


def test_a_server_that_cannot_start_fails_with_its_log_and_stops_the_one_started_with_it(tmp_path, tiny_model_dir):
    """Started together: the bad one exits while the good one is still importing; the good one
    is stopped too, and nothing is left running."""
    pytest.importorskip("vllm")
    good = VllmServer(ServerSpec(str(tiny_model_dir)), tmp_path / "good.log", start_timeout_s=120)
    bad = VllmServer(ServerSpec(str(tmp_path / "no-such-model")), tmp_path / "bad.log", start_timeout_s=120)
    with pytest.raises(ServerFailed, match="vllm serve exited with code") as info:
        start_together([good, bad])
    assert "no-such-model" in str(info.value)  # the log's tail says what vLLM refused
    assert not good.running and not bad.running
    assert not children_running("api_server")

