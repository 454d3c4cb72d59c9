import dataclasses

import pytest

from raytrain.config import DataConfig, FitConfig, OptimConfig, RunConfig, ScaleConfig
from raytrain.errors import UserError


def make(**optim: object) -> FitConfig:
    return FitConfig(optim=OptimConfig(**optim), run=RunConfig(storage="/s", name="r"))  # type: ignore[arg-type]


def test_round_trip_through_dict() -> None:
    cfg = make(epochs=3, lr=0.1)
    assert FitConfig.from_dict(cfg.to_dict()) == cfg


def test_fingerprint_ignores_what_may_change_between_attempts() -> None:
    base = make(epochs=3)
    longer = dataclasses.replace(base, optim=dataclasses.replace(base.optim, epochs=30))
    rescaled = dataclasses.replace(base, scale=ScaleConfig(workers=16, device="gpu"))
    assert base.fingerprint() == longer.fingerprint() == rescaled.fingerprint()


def test_fingerprint_changes_with_the_experiment() -> None:
    assert make(lr=0.02).fingerprint() != make(lr=0.05).fingerprint()
    assert make().fingerprint() != dataclasses.replace(make(), data=DataConfig(uri="/other")).fingerprint()


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
