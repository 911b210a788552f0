"""launch_router's argument handling and the routing-key header (no servers)."""

from sglang_kvshare.launch_router import parse_args, router_argv, worker_anchor_pool, worker_argv
from sglang_kvshare.routing import ROUTING_KEY_HEADER, routing_headers


def test_routing_headers_carry_the_workflow_only_for_a_usable_annotation():
    assert routing_headers({"kvshare": {"workflow": "wf-1", "agent": "a"}}) == {ROUTING_KEY_HEADER: "wf-1"}
    assert routing_headers({"text": "hi"}) == {}
    assert routing_headers({"kvshare": {"workflow": 3}}) == {}  # malformed: the worker answers 400
    assert routing_headers({"kvshare": {"workflow": "bad\nid"}}) == {}
    assert routing_headers({"kvshare": "x"}) == {}


def test_router_gets_affinity_defaults_unless_overridden():
    argv = router_argv("127.0.0.1", 30000, ["http://a:1", "http://b:2"], ["--policy", "round_robin"])
    assert argv[:6] == ["--host", "127.0.0.1", "--port", "30000", "--worker-urls", "http://a:1"]
    assert "--routing-key-override" in argv
    assert argv[argv.index("--routing-key-headers") + 1] == ROUTING_KEY_HEADER.lower()
    assert argv.count("--policy") == 1 and argv[argv.index("--policy") + 1] == "round_robin"
    assert "--prometheus-port" in argv


def test_other_flags_go_to_each_worker_with_its_own_port_and_pool(tmp_path):
    ns, rest = parse_args(["--workers", "2", "--port", "31000", "--model-path", "m",
                           "--kvshare-anchor-pool", str(tmp_path / "pool.pt"), "--router-arg=--log-level=info"])
    assert ns.workers == 2 and ns.port == 31000 and ns.router_arg == ["--log-level=info"]
    (tmp_path / "pool.pt").write_bytes(b"seed")
    argv = worker_argv(rest, "127.0.0.1", 31002, 1, 2)
    assert argv[1:3] == ["-m", "sglang_kvshare.launch_server"]
    assert argv[-4:] == ["--host", "127.0.0.1", "--port", "31002"]
    assert argv[argv.index("--kvshare-anchor-pool") + 1] == str(tmp_path / "pool.w1.pt")
    assert argv.count("--kvshare-anchor-pool") == 1 and "--model-path" in argv
    assert (tmp_path / "pool.w1.pt").read_bytes() == b"seed"  # seeded: the new worker starts warm
    assert worker_anchor_pool(str(tmp_path / "p.pt"), 0, 1) == str(tmp_path / "p.pt")
