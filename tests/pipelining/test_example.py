"""examples/gpt_pp.py trains a GPT with PP x FSDP x TP at parity with torch."""

import pytest

from examples import gpt_pp


@pytest.mark.parametrize("argv", [
    ["--pp", "2", "--steps", "2"],                                          # 2x2x2, 1F1B
    ["--pp", "2", "--mesh", "2x1x2", "--schedule", "ZBVZeroBubble", "--steps", "2",
     "--microbatches", "1", "--timeline"],                                  # m < stages
])
def test_example_trains_at_parity(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert gpt_pp.main(argv) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("parity OK"), out
    assert "bubble" in out


def test_a_backend_needs_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gpt_pp.main(["--backend", "nccl"])
    assert "--backend nccl needs torchrun" in capsys.readouterr().err


def test_split_points_refuse_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match="--layers"):
        gpt_pp.split_points(2, 4)


@pytest.mark.parametrize("module", [gpt_pp, gpt_pp.gpt], ids=["gpt_pp", "gpt"])
def test_example_docstrings_run(module: object) -> None:
    import doctest

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert result.attempted >= 1 and result.failed == 0, result
