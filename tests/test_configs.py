"""Every shipped config loads, and flags override it."""

import argparse
from pathlib import Path

import pytest

from mlxgw import config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {"single-mac.toml", "multi-model.toml", "multi-mac.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    cfg = config.load(str(path))
    assert cfg.models and all(m.name and m.path and m.backends >= 1 for m in cfg.models)
    ports = [p for m in cfg.models for p in range(m.port, m.port + m.backends)]
    assert len(ports) == len(set(ports)) and cfg.port not in ports


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_configs_keep_the_measured_routing_defaults(path):
    # A shipped example once pinned load_weight 0 after the measured default moved on,
    # so everyone who copied it got requests piling onto prefix owners.
    from gateway.route import RoutingConfig

    cfg = config.load(str(path))
    assert {k: v for k, v in cfg.routing.items() if v != getattr(RoutingConfig(), k, v)} == {}


def test_flags_override_file():
    cfg = config.load(str(CONFIGS[0]))
    args = argparse.Namespace(model="/tmp/m", served_name="x", backends=5, port=9000, redis_url=None,
                              host=None, namespace=None, block_size=None, backend_port=None,
                              cache_bytes="1GB", cache_entries=None)
    cfg = config.apply_flags(cfg, args)
    m = cfg.models[0]
    assert (cfg.port, m.path, m.name, m.backends, m.cache_bytes) == (9000, "/tmp/m", "x", 5, "1GB")


def test_unknown_keys_are_errors(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[gateway]\nprot = 1\n")
    with pytest.raises(ValueError, match="prot"):
        config.load(str(p))


def test_serve_passes_routing_and_keepalive_to_the_gateway(tmp_path):
    from mlxgw import launcher

    p = tmp_path / "c.toml"
    p.write_text('[routing]\nbalance_abs_tokens = 4096\n[gateway]\nkeepalive = 2.5\n')
    cfg = config.load(str(p))
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    cfg = config.apply_flags(cfg, parser.parse_args(["--routing-policy", "least_loaded"]))
    assert cfg.routing == {"balance_abs_tokens": 4096, "policy": "least_loaded"} and cfg.keepalive == 2.5
    flags = launcher.gateway_security_flags(cfg)
    assert flags[flags.index("--keepalive") + 1] == "2.5"
    with pytest.raises(ValueError, match="policy must be one of"):
        (tmp_path / "d.toml").write_text('[routing]\npolicy = "random"\n')
        config.load(str(tmp_path / "d.toml"))


def test_serve_passes_prefill_settings_to_the_backends(tmp_path):
    from mlxgw import launcher

    p = tmp_path / "c.toml"
    p.write_text('[[models]]\nname = "m"\nprefill_concurrency = 1\nprefill_order = "step-beside"\n')
    flags = launcher.backend_model_flags(config.load(str(p)).models[0])
    assert flags[flags.index("--prefill-concurrency") + 1] == "1"
    assert flags[flags.index("--prefill-order") + 1] == "step-beside"
    default = launcher.backend_model_flags(config.ModelConfig())
    from backend.engine import DEFAULT_PREFILL_ORDER
    assert default[default.index("--prefill-order") + 1] == DEFAULT_PREFILL_ORDER == "step-beside"
    (tmp_path / "d.toml").write_text('[[models]]\nprefill_order = "lifo"\n')
    with pytest.raises(ValueError, match="prefill_order must be one of fifo, shorter-beside, step-beside"):
        config.load(str(tmp_path / "d.toml"))
