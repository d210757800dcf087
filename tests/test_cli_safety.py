"""The command line refuses what it cannot do safely: each bad input gets an error that names the
problem and the fix, before any work, and nothing a user owns is deleted."""

import pytest

from eagle_tree.commands.demo import main as demo_main
from eagle_tree.commands.export import ExportConfig
from eagle_tree.commands.flags import flags_to_overrides, parse_flags


# ----------------------------------------------------------------------------------------- one config convention
def test_flags_and_key_values_give_the_same_config():
    flags = ["--to", "vllm", "heads/a", "out/b", "--speculative-tokens", "5", "--dtype=bfloat16", "--overwrite"]
    keys = ["to=vllm", "checkpoint=heads/a", "out=out/b", "speculative_tokens=5", "dtype=bfloat16", "overwrite=true"]
    assert flags_to_overrides(ExportConfig, flags, ("checkpoint", "out")) == keys
    a = parse_flags(ExportConfig, flags, "eagle-tree export", ("checkpoint", "out"))
    b = parse_flags(ExportConfig, keys, "eagle-tree export", ("checkpoint", "out"))
    assert a == b and a.overwrite and a.speculative_tokens == 5


@pytest.mark.parametrize("argv, message", [
    (["--to", "vllm", "a", "b", "c"], "unexpected argument 'c'"),
    (["--to", "vllm", "a"], "missing required config key(s): out"),
    (["--to", "vlm", "a", "b"], "expected one of 'eagle3', 'sglang', 'vllm'"),
    (["--tagret", "x", "--to", "vllm", "a", "b"], "did you mean 'target'"),
    (["--to", "vllm", "a", "b", "--target"], "option --target needs a value"),
])
def test_export_command_line_errors(argv, message, capsys):
    from eagle_tree.commands.export import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_reads_flags_and_refuses_zero_samples(capsys):
    assert demo_main(["--samples", "200", "--seed", "3"]) == 0
    assert "acceptance rate" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        demo_main(["samples=0"])
    assert "samples must be an integer >= 1, got 0" in capsys.readouterr().err
