import dataclasses

import pytest

from raytrain import cli
from raytrain.errors import UserError
from raytrain.recipe.config import OPTIONS, SECTIONS, DataConfig, FitConfig, OptimConfig
from raytrain.service.config import RunConfig, ScaleConfig, fingerprint


def make(**optim: object) -> FitConfig:
    return FitConfig(optim=OptimConfig(**optim))  # type: ignore[arg-type]


def test_round_trip_through_dict() -> None:
    cfg = make(epochs=3, lr=0.1)
    assert FitConfig.from_dict(cfg.to_dict()) == cfg


def test_experiment_ignores_what_may_change_between_attempts() -> None:
    base = make(epochs=3)
    longer = dataclasses.replace(base, optim=dataclasses.replace(base.optim, epochs=30))
    assert fingerprint(base.experiment()) == fingerprint(longer.experiment())
    streamed = dataclasses.replace(base, data=dataclasses.replace(base.data, stream=True))
    assert fingerprint(base.experiment()) == fingerprint(streamed.experiment())  # how data arrives, not what
    normal = dataclasses.replace(base, data=dataclasses.replace(base.data, decode_priority="normal"))
    assert fingerprint(base.experiment()) == fingerprint(normal.experiment())  # how decoding is scheduled


def test_fingerprint_changes_with_the_experiment() -> None:
    assert fingerprint(make(lr=0.02).experiment()) != fingerprint(make(lr=0.05).experiment())
    other_data = dataclasses.replace(make(), data=DataConfig(uri="/other"))
    assert fingerprint(make().experiment()) != fingerprint(other_data.experiment())


@pytest.mark.parametrize(
    ("build", "flag"),
    [
        (lambda: ScaleConfig(workers=0), "--workers 0"),
        (lambda: ScaleConfig(pg_timeout_s=1), "--pg-timeout"),
        (lambda: OptimConfig(epochs=0), "--epochs 0"),
        (lambda: OptimConfig(batch_size=0), "--batch-size 0"),
        (lambda: OptimConfig(lr=-1), "--lr -1"),
        (lambda: DataConfig(val_fraction=1.0), "--val-fraction"),
        (lambda: RunConfig(storage="/s", name="a/b"), "--name"),
        (lambda: RunConfig(storage="/s", name="r", keep=0), "--keep 0"),
    ],
)
def test_invalid_values_name_their_flag(build: object, flag: str) -> None:
    with pytest.raises(UserError, match=flag):
        build()  # type: ignore[operator]


def test_every_recipe_field_is_an_option_of_fit_with_its_default_and_type() -> None:
    """The recipe's options are generated from its config: nothing here is listed by hand."""
    params = {p.name: p for p in cli.fit.params}
    resolved = {(s.__name__, f.name) for s in SECTIONS for f in dataclasses.fields(s) if "cli" not in f.metadata}
    assert resolved == {("DataConfig", "uri"), ("DataConfig", "num_classes"), ("DataConfig", "classes")}
    for o in OPTIONS:
        param = params[o.param]
        assert param.default == getattr(o.section(), o.field), o.flag
        assert o.flag in param.opts, o.flag
        assert param.is_flag == (o.type is bool), o.flag  # type: ignore[attr-defined]
        if o.how.choices:
            assert tuple(param.type.choices) == o.how.choices, o.flag  # type: ignore[attr-defined]
    assert len({o.param for o in OPTIONS}) == len(OPTIONS)


def test_the_generated_help_states_each_default_once() -> None:
    ctx = cli.fit.make_context("fit", [])
    for o in OPTIONS:
        record = next(p for p in cli.fit.params if p.name == o.param).get_help_record(ctx)
        assert record is not None
        said = record[1].lower().count("default:")
        assert said == 1 if o.default not in (None, False) else said <= 1, (o.flag, record[1])


def test_options_reach_the_config_under_their_own_field() -> None:
    ctx = cli.fit.make_context(
        "fit", ["--lr", "0.5", "--no-amp", "--synthetic-data", "--model", "m:f", "--augment", "flip"]
    )
    cfg = FitConfig.from_options(ctx.params, "/data")
    assert (cfg.optim.lr, cfg.optim.amp, cfg.data.synthetic, cfg.model.name) == (0.5, False, True, "m:f")
    assert (cfg.data.augment, cfg.data.uri, cfg.optim.epochs) == ("flip", "/data", OptimConfig().epochs)


def test_a_choice_outside_the_options_is_refused_naming_the_flag() -> None:
    with pytest.raises(UserError, match=r"--optimizer 'lamb' is not one of sgd, adamw"):
        OptimConfig(optimizer="lamb")
    with pytest.raises(UserError, match=r"--auto-augment 'x' is not one of ta_wide"):
        DataConfig(auto_augment="x")
