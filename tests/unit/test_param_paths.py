"""train.ParamPaths: the weight sync reads the policy's named parameters through each one's
module and attribute instead of walking every module each sync; what it reads must be what
named_parameters() gives at that moment."""

from __future__ import annotations

import torch

from rljob_worker.train import ParamPaths


def _model() -> torch.nn.Sequential:
    model = torch.nn.Sequential(
        torch.nn.Embedding(8, 4),
        torch.nn.Linear(4, 4),
        torch.nn.LayerNorm(4),
        torch.nn.Linear(4, 8),
    )
    model[3].weight = model[0].weight  # tied: named_parameters gives it once
    return model


def _same(read: dict[str, torch.Tensor], model: torch.nn.Module) -> bool:
    walked = dict(model.named_parameters())
    return list(read) == list(walked) and all(read[n] is walked[n] for n in walked)


def test_it_reads_what_named_parameters_gives_each_time_even_after_a_parameter_is_replaced() -> (
    None
):
    model = _model()
    paths = ParamPaths(model)
    assert _same(paths.read(), model)
    assert "3.weight" not in paths.read()  # the tied head, once, under the walk's first name
    # A module's parameter replaced (FSDP2 swaps sharded and unsharded ones this way): the
    # next read has the new object, not the one the walk found.
    model[1].weight = torch.nn.Parameter(torch.zeros(4, 4))
    assert _same(paths.read(), model)
    assert paths.read()["1.weight"] is model[1].weight
    # An attribute that no longer holds a parameter: a new walk.
    del model[2].bias
    model[2].bias = None  # type: ignore[assignment]
    assert _same(paths.read(), model)
    assert "2.bias" not in paths.read()


def test_after_the_first_read_no_walk_over_the_modules() -> None:
    model = _model()
    paths = ParamPaths(model)
    paths.read()
    walks = []
    real = torch.nn.Module.named_parameters

    def counted(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
        walks.append(1)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    torch.nn.Module.named_parameters = counted  # type: ignore[assignment]
    try:
        for _ in range(3):
            paths.read()
    finally:
        torch.nn.Module.named_parameters = real  # type: ignore[method-assign]
    assert walks == []
