"""``kvstrata route``'s bad input: a clear 400 for a body it cannot route, 503 with nothing up, one line
for a bad command line. The router's real aiohttp app on a loopback port; its servers here are
ports nothing listens on (no engine needed to refuse a body)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvstrata import cli
from kvstrata.fleet.front import FrontConfig, Upstream, make_app
from kvstrata.fleet.prompt import AskServer, BadRequest, Endpoint, Tokens, tokenize_ask
from kvstrata.integrations.vllm.server import free_port


def run_against(config: FrontConfig, scenario):
    async def go():
        async with TestClient(TestServer(make_app(config))) as client:
            return await scenario(client)
    return asyncio.run(go())


def nowhere() -> FrontConfig:
    return FrontConfig((Upstream(f"http://127.0.0.1:{free_port()}"),), health_interval_s=60)


def test_a_body_that_cannot_be_routed_is_a_400_saying_why():
    async def scenario(client):
        out = []
        for path, data in (("/v1/completions", b"{not json"), ("/v1/completions", b"[1, 2]"),
                           ("/v1/chat/completions", b'{"model": "m"}'), ("/v1/completions", b'{"prompt": 7}')):
            answer = await client.post(path, data=data, headers={"Content-Type": "application/json"})
            out.append((answer.status, (await answer.json())["error"]["message"]))
        return out

    answers = run_against(nowhere(), scenario)
    assert [status for status, _ in answers] == [400] * 4
    assert answers[0][1].startswith("the request body is not JSON")
    assert answers[1][1] == "the request body must be a JSON object, got list"
    assert answers[2][1] == "a chat completion needs 'messages', a non-empty list"
    assert answers[3][1].startswith("a completion needs 'prompt'")


def test_with_no_server_up_a_request_is_a_503_and_health_says_so():
    async def scenario(client):
        answer = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
        health = await client.get("/health")
        metrics = await (await client.get("/metrics")).text()
        return answer.status, (await answer.json())["error"]["message"], health.status, await health.json(), metrics

    status, message, health_status, health, metrics = run_against(nowhere(), scenario)
    assert (status, message) == (503, "no server is up to take the request")
    assert health_status == 503 and health["servers"][0]["health"] == "down"
    assert 'kvstrata_route_rejected_total{reason="no_server"} 1.0' in metrics
    assert "kvstrata_route_server_up{server=" in metrics


def test_what_a_router_tokenizes():
    assert tokenize_ask(Endpoint.COMPLETIONS, {"prompt": [5, 6]}) == Tokens((5, 6))
    assert tokenize_ask(Endpoint.COMPLETIONS, {"model": "m", "prompt": ["a", "b"]}) == \
        AskServer({"model": "m", "prompt": "a"})  # a batch goes to one server, routed on its first
    chat = tokenize_ask(Endpoint.CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": [],
                                        "temperature": 0})
    assert chat == AskServer({"messages": [{"role": "user", "content": "hi"}], "tools": []})
    with pytest.raises(BadRequest, match="'prompt'"):
        tokenize_ask(Endpoint.COMPLETIONS, {"prompt": [True]})


@pytest.mark.parametrize(("argv", "line"), [
    (["route"], "no servers to route to: give --server URL"),
    (["route", "--server", "http://127.0.0.1:9", "--policy", "fastest"], "unknown routing policy 'fastest'"),
    (["route", "--server", "127.0.0.1:9"], "a server is a base URL like http://127.0.0.1:8000"),
    (["route", "--server", "http://a:1", "--server", "http://b:1", "--events", "tcp://a:2"], "1 --events for 2 --server"),
    (["route", "--server", "http://a:1", "--slo-tpot-ms", "50"], "give --slo-ttft-ms and --slo-tpot-ms together"),
    (["route", "--server", "http://a:1", "--slo-ttft-ms", "0", "--slo-tpot-ms", "50"],
     "--slo-ttft-ms and --slo-tpot-ms must be > 0, got 0 and 50"),
])
def test_a_bad_command_line_is_one_line(argv, line, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert line in err and err.count("\n") == 1


def test_the_slo_given_reaches_the_policy_that_routes():
    import argparse

    from kvstrata.cli.route import config, register
    from kvstrata.fleet.front import ROUTER, make_app
    from kvstrata.slo import Slo

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    given = parser.parse_args(["route", "--server", "http://127.0.0.1:9", "--slo-ttft-ms", "500", "--slo-tpot-ms", "40"])
    assert make_app(config(given))[ROUTER].policy.slo == Slo(0.5, 0.04)
    assert make_app(config(parser.parse_args(["route", "--server", "http://127.0.0.1:9"])))[ROUTER].policy.slo is None


def test_a_calibrated_host_prices_the_servers(tmp_path):
    """``--calibration`` with ``--model-dir``: the model's prefill fit on this host is every server's
    per-token cost, its KV bytes size a block; without ``--model-dir``, one line."""
    import json

    from kvstrata.calibrate import profile_text
    from kvstrata.cli.route import calibrated_cost, register
    from kvstrata.hardware.profile import builtin_text
    from kvstrata.plan import host as h
    from kvstrata.plan.calpaths import CalPath

    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 512, "vocab_size": 1000,
        "torch_dtype": "bfloat16", "max_position_embeddings": 2048}))
    cal = h.HostCalibration("box", "cpu", 2, {CalPath.MEMCPY_1T: h.PathFit(0.0, 10.0)},
                            {"my-model": h.PrefillFit(0.01, 2e4)})
    profile = tmp_path / "p.toml"
    profile.write_text(profile_text(cal, builtin_text("workstation")))
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["route", "--server", "http://127.0.0.1:9", "--calibration", str(profile),
                              "--model-dir", str(model), "--block-size", "32"])
    cost = calibrated_cost(args)
    assert cost.per_token_s == pytest.approx(1 / 2e4) and cost.block_tokens == 32
    args.model_dir = None
    with pytest.raises(cli.CliError, match="--calibration needs --model-dir"):
        calibrated_cost(args)


def test_the_command_serves_until_stopped(tmp_path):
    """``kvstrata route`` as a process: it listens, says which server is down, and stops on SIGTERM."""
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    port, nobody = free_port(), free_port()
    code = ("import sys; from kvstrata.cli import main; "
            f"sys.exit(main(['route', '--server', 'http://127.0.0.1:{nobody}', '--port', '{port}']))")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline, answer = time.monotonic() + 60, None
        while answer is None and time.monotonic() < deadline and process.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            except urllib.error.HTTPError as e:
                answer = (e.code, json.loads(e.read()))
            except OSError:
                time.sleep(0.2)
        assert answer is not None, process.stdout.read().decode() if process.poll() is not None else "no answer"
        assert answer[0] == 503 and answer[1]["servers"][0]["health"] == "down"
    finally:
        process.terminate()
        out = process.communicate(timeout=30)[0].decode()
    assert "kvstrata route: predicted-ttft over 1 server(s)" in out
    assert process.returncode == 0, out
