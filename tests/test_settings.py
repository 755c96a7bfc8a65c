"""Settings flags: each command adds them from one table, a flag wins over its environment
variable, and a flag not given leaves the variable's value."""
from __future__ import annotations

import argparse

import pytest

from thc.codec import settings


def _parse(argv, *names):
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, *names)
    return parser.parse_args(argv)


def test_a_flag_wins_over_its_variable_and_an_absent_flag_leaves_it():
    env = {"THC_CLIENT_DATAPATH": "python", "THC_CODEC_CPU": "reference",
           "THC_AGGREGATOR_DATAPATH": "compiled"}
    args = _parse(["--client-datapath", "compiled"], "client_datapath", "codec_cpu",
                  "aggregator_datapath")
    chosen = settings.from_args(args, env)
    assert (chosen.client_datapath, chosen.codec_cpu, chosen.aggregator_datapath) == \
        ("compiled", "reference", "compiled")
    args = _parse(["--datapath", "python", "--codec-cpu", "compiled"], "aggregator_datapath",
                  "codec_cpu")
    chosen = settings.from_args(args, {})
    assert (chosen.client_datapath, chosen.codec_cpu, chosen.aggregator_datapath) == \
        ("auto", "compiled", "python")


def test_only_the_settings_asked_for_get_flags_and_their_choices_are_checked(capsys):
    args = _parse([], "codec_cpu")
    assert vars(args) == {"codec_cpu": None}
    with pytest.raises(SystemExit):
        _parse(["--codec-cpu", "fast"], "codec_cpu")
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["--client-datapath", "python"], "codec_cpu")
    # a flag takes any case, as its variable does (THC_CODEC_CPU=Reference is reference)
    assert vars(_parse(["--codec-cpu", "Reference"], "codec_cpu")) == {"codec_cpu": "reference"}


def test_every_flag_names_its_variable_in_its_help():
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, *settings.FLAGS)
    text = parser.format_help()
    assert all(settings.ENV[name] in text for name in settings.FLAGS)


def test_the_described_data_folder_says_when_it_is_absent(tmp_path):
    there = settings.from_args(argparse.Namespace(), {"THC_FASHION_MNIST": str(tmp_path)})
    assert there.describe().endswith(f"Fashion-MNIST {tmp_path}")
    gone = settings.from_args(argparse.Namespace(), {"THC_FASHION_MNIST": str(tmp_path / "x")})
    assert gone.describe().endswith(f"Fashion-MNIST {tmp_path / 'x'} (absent)")


def test_environment_values_take_any_case_and_gso_takes_auto_0_or_1():
    """THC_CODEC_CPU=Reference is reference, as its flag is; THC_CLIENT_GSO=AUTO is unset;
    anything but auto, 0 or 1 is refused rather than read as off."""
    got = settings.Settings.from_env({"THC_CODEC_CPU": "Reference", "THC_CLIENT_GSO": "AUTO"})
    assert got.codec_cpu == "reference" and got.client_gso is None
    assert settings.Settings.from_env({"THC_CLIENT_GSO": "1"}).client_gso is True
    assert settings.Settings.from_env({"THC_CLIENT_GSO": "0"}).client_gso is False
    with pytest.raises(ValueError, match="THC_CLIENT_GSO"):
        settings.Settings.from_env({"THC_CLIENT_GSO": "yes"})


def test_with_flags_leaves_a_setting_whose_flag_is_not_given():
    """None is "not given": it keeps the value rather than replacing it."""
    base = settings.Settings(codec_cpu="reference")
    assert base.with_flags(codec_cpu=None, client_datapath="python") == \
        settings.Settings(codec_cpu="reference", client_datapath="python")


def test_described_gso_says_on_off_or_auto():
    """The run's settings line is how a log says which datapath a client took."""
    assert "client GSO on," in settings.Settings(client_gso=True).describe()
    assert "client GSO off," in settings.Settings(client_gso=False).describe()
    assert "client GSO auto," in settings.Settings().describe()
