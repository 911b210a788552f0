import pytest

from sglang_kvshare.testing.server import kvshare_server, stock_server
from sglang_kvshare.testing.tiny_model import build_tiny_llama

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def smollm2_path():
    from sglang_kvshare.assets import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smollm2_path):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_path)


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("tiny-server")
    server = kvshare_server(tiny_model, d / "server.log", "--kvshare-dump-dir", str(d / "dumps"), "--enable-metrics")
    server.dump_dir = d / "dumps"
    server.model_path = tiny_model
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_stock_server(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("tiny-stock")
    server = stock_server(tiny_model, d / "server.log")
    yield server
    server.stop()
