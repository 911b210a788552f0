"""launch_router's argument handling and the routing-key header (no servers)."""

import pytest

from sglang_kvshare.launch_router import parse_args
from sglang_kvshare.router_argv import router_argv, worker_anchor_pool, worker_argv
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
    at = argv.index("--routing-key-headers")
    # the automatic-sharing scope header first, then the router's own
    assert argv[at + 1 : at + 3] == ["x-kvshare-workflow", ROUTING_KEY_HEADER.lower()]
    assert argv.count("--policy") == 1 and argv[argv.index("--policy") + 1] == "round_robin"
    assert "--prometheus-port" in argv


def test_other_flags_go_to_each_worker_with_its_own_port_and_pool(tmp_path):
    ns, rest = parse_args(
        [
            "--workers",
            "2",
            "--port",
            "31000",
            "--model-path",
            "m",
            "--kvshare-anchor-pool",
            str(tmp_path / "pool.pt"),
            "--router-arg=--log-level=info",
        ]
    )
    assert ns.workers == 2 and ns.port == 31000 and ns.router_arg == ["--log-level=info"]
    argv = worker_argv(rest, "127.0.0.1", 31002, 1, 2)
    assert argv[1:3] == ["-m", "sglang_kvshare.launch_server"]
    assert argv[-4:] == ["--host", "127.0.0.1", "--port", "31002"]
    assert argv[argv.index("--kvshare-anchor-pool") + 1] == str(tmp_path / "pool.w1.pt")
    assert argv.count("--kvshare-anchor-pool") == 1 and "--model-path" in argv
    assert "--kvshare-anchor-pool-seed" not in argv  # no pool.pt yet: a cold start
    (tmp_path / "pool.pt").write_bytes(b"seed")
    argv = worker_argv(rest, "127.0.0.1", 31002, 1, 2)
    # pool.pt exists: the worker's seed (read by the worker, which checks it; never copied)
    assert argv[argv.index("--kvshare-anchor-pool-seed") + 1] == str(tmp_path / "pool.pt")
    assert not (tmp_path / "pool.w1.pt").exists()
    given = worker_argv([*rest, "--kvshare-anchor-pool-seed", "other.pt"], "127.0.0.1", 31002, 1, 2)
    assert given.count("--kvshare-anchor-pool-seed") == 1 and "other.pt" in given  # a given seed wins
    assert worker_anchor_pool(str(tmp_path / "p.pt"), 0, 1) == str(tmp_path / "p.pt")
    single = worker_argv(rest, "127.0.0.1", 31001, 0, 1)  # one worker: pool.pt is its own file
    assert "--kvshare-anchor-pool-seed" not in single


@pytest.fixture
def model_dirs(tmp_path):
    """Two model directories of different shapes (configurations only: what the header reads)."""
    from transformers import LlamaConfig

    dirs = []
    for name, layers in (("model-a", 2), ("model-b", 3)):
        LlamaConfig(
            num_hidden_layers=layers,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        ).save_pretrained(tmp_path / name)
        dirs.append(str(tmp_path / name))
    return dirs


def test_a_seed_must_exist_and_fit_the_server(tmp_path, model_dirs):
    from sglang_kvshare.config import KVShareArgs
    from sglang_kvshare.correction import store
    from sglang_kvshare.correction.warm_start import check_file, header, load_path, model_identity

    a, b = model_dirs
    seed = tmp_path / "seed.pt"
    args = KVShareArgs(anchor_pool_seed=str(seed))
    with pytest.raises(store.AnchorPoolFileError, match=r"^--kvshare-anchor-pool-seed: .*seed.pt does not exist"):
        check_file(args, a)
    seed.write_bytes(b"not a pool")
    with pytest.raises(store.AnchorPoolFileError, match=r"^--kvshare-anchor-pool-seed: .*not a readable anchor pool"):
        check_file(args, a)
    assert seed.read_bytes() == b"not a pool"  # left as it was
    store.save(str(seed), header(args, model_identity(a)), {})
    assert check_file(args, a) == model_identity(a)
    with pytest.raises(
        store.AnchorPoolFileError, match=r"^--kvshare-anchor-pool-seed: .*another model .*num_hidden_layers"
    ):
        check_file(args, b)  # the same file on a server of another model
    with pytest.raises(store.AnchorPoolFileError, match=r"rank: file 32, server 8"):
        check_file(KVShareArgs(anchor_pool_seed=str(seed), rank=8), a)
    # which file a server starts from: its own once it exists, else the seed
    own = tmp_path / "own.pt"
    both = KVShareArgs(anchor_pool=str(own), anchor_pool_seed=str(seed))
    assert load_path(both) == str(seed)
    check_file(both, a)  # an own file that does not exist yet is fine
    store.save(str(own), header(both, model_identity(a)), {})
    assert load_path(both) == str(own)
    assert load_path(KVShareArgs()) is None
