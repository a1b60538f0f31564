"""Value ranges of train.* / checkpoint.* keys (training/validate.py::check_training_keys): one ConfigError line."""

import pytest

from mptrain.training.validate import validate_config
from mptrain.errors import ConfigError
from train_utils import compose


@pytest.mark.parametrize("overrides,message", [
    (["train.clip_grad=-1"], "train.clip_grad=-1.0 must be a finite number >= 0 (0 = no clipping)"),
    (["train.clip_grad=nan"], "train.clip_grad=nan must be a finite number >= 0"),
    (["checkpoint.keep_last_n=-2"], "checkpoint.keep_last_n=-2 must be >= 1, or 0 / null (keep every checkpoint)"),
    (["checkpoint.load=/x", "checkpoint.load_iteration=-1"], "checkpoint.load_iteration=-1 must be >= 0"),
    (["checkpoint.load_iteration=4"], "checkpoint.load_iteration=4 needs checkpoint.load=<folder>"),
    # keys with no effect where nothing is saved / loaded: the user meant something else
    (["checkpoint.keep_last_n=2"], "checkpoint.keep_last_n=2 has no effect without checkpoint.save=<folder>; set it, "
                                   "or checkpoint.keep_last_n=null"),
    (["checkpoint.async_save=true"], "checkpoint.async_save=true has no effect without checkpoint.save=<folder>; set "
                                     "it, or checkpoint.async_save=false"),
    (["checkpoint.load_optim=false"], "checkpoint.load_optim=false has no effect without checkpoint.load=<folder>; "
                                      "set it, or checkpoint.load_optim=true"),
    (["checkpoint.load_rng=false"], "checkpoint.load_rng=false has no effect without checkpoint.load=<folder>"),
])
def test_out_of_range_training_keys_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate_config(compose(["model=tiny", *overrides]), 1)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_in_range_values_pass():
    validate_config(compose(["model=tiny", "train.clip_grad=0", "checkpoint.keep_last_n=0"]), 1)
