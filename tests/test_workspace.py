"""grown_workspace: per-device scratch that only grows, the replaced buffers kept alive for captured graphs."""
import torch

from specverify import workspace


def _make(n):
    return torch.empty(n[0]), torch.zeros(n[1], dtype=torch.int32)


def test_workspace_reused_grown_and_retired(monkeypatch):
    monkeypatch.setattr(workspace, "_RETIRED", [])
    store, dev = {}, torch.device("cpu")
    a = workspace.grown_workspace(store, dev, (8, 4), _make, "op")
    assert [t.numel() for t in a] == [8, 4]
    assert workspace.grown_workspace(store, dev, (5, 4), _make, "op") is a  # big enough: the same buffers
    b = workspace.grown_workspace(store, dev, (6, 9), _make, "op")  # one buffer short: both rebuilt, none shrinks
    assert b is not a and [t.numel() for t in b] == [8, 9]
    assert workspace._RETIRED == [a]  # kept alive for graphs that captured it
    assert store == {("cpu", None): b}
