"""Config validation, overrides and round trips: bad values raise errors naming the field."""

import importlib

import pytest

from fibjax.config import AttentionConfig, ConfigError, ModelConfig, apply_overrides, from_dict, to_dict


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(window=-1), "window"),
        (dict(kind="sparse"), "kind"),
        (dict(base="fib"), "base"),
        (dict(base=(0, 3)), "base"),
        (dict(alpha="linear"), "alpha"),
        (dict(alpha=(0.4, 1.0)), "alpha"),
        (dict(alpha=(1.0, 1.6)), "alpha"),
        (dict(implementation="cuda"), "implementation"),
        (dict(max_rung=-1), "max_rung"),
        (dict(base="pow2", max_rung=255), "max_rung"),
        (dict(base=(8, 13), max_rung=5), "max_rung"),
    ],
)
def test_attention_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        AttentionConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_heads=8, num_kv_heads=3), "num_heads"),
        (dict(d_model=100, num_heads=8), "d_model"),
        (dict(num_layers=0), "num_layers"),
        (dict(dtype="float16"), "dtype"),
        (dict(num_layers=4, attention=AttentionConfig(kind="offset", alpha=(1.0, 1.0))), "alpha"),
    ],
)
def test_model_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**kwargs)


def test_overrides_parse_types_and_name_bad_keys():
    cfg = ModelConfig()
    cfg = apply_overrides(cfg, ["attention.kind=offset", "attention.window=8", "attention.alpha=staggered", "d_model=256", "remat=true"])
    assert cfg.attention.kind == "offset" and cfg.attention.window == 8 and cfg.attention.alpha == "staggered"
    assert cfg.d_model == 256 and cfg.remat == "full"  # the boolean form reads as full
    cfg = apply_overrides(cfg, ["attention.base=(1,2,4)", "num_layers=2", "attention.alpha=(0.5,1.5)", "rope_theta=5e5"])
    assert cfg.attention.base == (1, 2, 4) and cfg.attention.alpha == (0.5, 1.5) and cfg.rope_theta == 500000.0
    with pytest.raises(ConfigError, match="attention.windw"):
        apply_overrides(cfg, ["attention.windw=3"])
    with pytest.raises(ConfigError, match="attention.window"):
        apply_overrides(cfg, ["attention.window=-2"])
    with pytest.raises(ConfigError, match="num_layers"):
        apply_overrides(cfg, ["num_layers=many"])
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(cfg, ["num_layers"])


def test_dict_round_trip_and_unknown_keys():
    cfg = ModelConfig(attention=AttentionConfig(kind="offset", base=(1, 3), alpha="coprime", learn_alpha=True))
    assert from_dict(ModelConfig, to_dict(cfg)) == cfg
    d = to_dict(cfg)
    d["attention"]["colour"] = "red"
    with pytest.raises(ConfigError, match="colour"):
        from_dict(ModelConfig, d)


def test_derived_sizes():
    cfg = ModelConfig()
    assert cfg.resolved_head_dim == 64 and cfg.resolved_mlp_hidden == 1366
    assert AttentionConfig(kind="offset", alpha="staggered").layer_alphas(3) == (0.5, 1.0, 1.5)
    assert AttentionConfig(kind="offset", alpha="learned").is_learned
    assert AttentionConfig(kind="offset", alpha="staggered", learn_alpha=True).is_learned
    assert not AttentionConfig(kind="dense", learn_alpha=True).is_learned


def test_loading_a_config_imports_no_jax():
    """Config files, recipes and the offset geometry are pure Python: a planning tool or a
    launcher can read them without starting JAX or importing the kernels."""
    import subprocess
    import sys

    code = (
        "import sys, fibjax.config, fibjax.recipes, fibjax.attention.offsets; "
        "fibjax.config.load_config_file('configs/cpu/fib_stagger_w8.py'); "
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'flax', 'fibjax.attention.pallas'))))"
    )
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_readme_shows_the_commands_the_paper_configs_name():
    """A paper config without its data fails with a prepare command (fibjax.recipes); the README
    must show the same commands."""
    from pathlib import Path

    from fibjax.recipes import PREPARE_PAPER, PREPARE_SSA

    readme = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().replace("\\\n", " ").split())
    assert PREPARE_PAPER in readme and PREPARE_SSA in readme


def test_rope_words_apply_in_any_order():
    """``launch.eval --rope scaling=yarn factor=4 original_len=256``: yarn needs the length that
    comes after it; the model is checked once with all the words."""
    from fibjax.config import apply_overrides
    from fibjax.eval.runner import rope_overrides
    from fibjax.recipes import ssa_cpu

    model = ssa_cpu("fullattn").model
    for words in (["scaling=yarn", "factor=4", "original_len=256"], ["original_len=256", "scaling=yarn", "factor=4"]):
        m = apply_overrides(model, rope_overrides(words))
        assert (m.rope_scaling, m.rope_factor, m.rope_original_len) == ("yarn", 4.0, 256)


def test_overrides_are_checked_together_in_any_order():
    """A section is rebuilt once with all its overrides: a check across fields (yarn needs
    rope_original_len) sees them together, whatever order they are written in; the last of a
    repeated key wins; conflicting and unknown keys name the override."""
    from fibjax.config import TrainConfig

    words = ["model.rope_scaling=yarn", "model.rope_factor=4", "model.rope_original_len=256", "steps=7", "steps=9"]
    for order in (words, words[::-1][1:] + ["steps=9"]):
        cfg = apply_overrides(TrainConfig(), order)
        assert (cfg.model.rope_scaling, cfg.model.rope_original_len, cfg.steps) == ("yarn", 256, 9)
    with pytest.raises(ConfigError, match="model.rope_original_len: yarn needs"):
        apply_overrides(TrainConfig(), ["model.rope_scaling=yarn", "model.rope_factor=4"])
    with pytest.raises(ConfigError, match=r"model.attention.windw: unknown key 'windw'"):
        apply_overrides(TrainConfig(), ["model.attention.windw=3"])
    with pytest.raises(ConfigError, match=r"modle.rope_theta: unknown key 'modle'"):
        apply_overrides(TrainConfig(), ["modle.rope_theta=3"])
    with pytest.raises(ConfigError, match="other overrides set fields inside it"):
        apply_overrides(TrainConfig(), ["model.attention.window=3", "model.attention=4"])
    with pytest.raises(ConfigError, match="given a value by another override"):
        apply_overrides(TrainConfig(), ["model.attention=4", "model.attention.window=3"])
    with pytest.raises(ConfigError, match=r"steps.x: 'steps' is a value, not a section"):
        apply_overrides(TrainConfig(), ["steps.x=3"])


@pytest.mark.parametrize(
    "module, argv",
    [
        ("launch.eval", ["--workdir", "W", "--lengths", "256,,512"]),
        ("launch.passkey", ["--workdir", "W", "--lengths", "256,,512"]),
        ("launch.passkey", ["--workdir", "W", "--depths", "0,0.5,"]),
        ("launch.bench", ["attention", "--seq", ",1024"]),
        ("launch.bench", ["decode", "--context", "1024,,4096"]),
        ("launch.probe", ["--depths", "2,,4", "--plan"]),
    ],
)
def test_an_empty_item_in_a_comma_list_is_refused(module, argv, capsys):
    """``--lengths 256,,512`` ran silently as 256,512: a typo is refused, naming the list."""
    with pytest.raises(SystemExit) as caught:
        importlib.import_module(module).main(argv)
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "has an empty item" in err and err.count("error:") == 1, err
