"""A wrapped hook runs the object's own hook, a function set on the instance included, and gets it back after."""

from __future__ import annotations

import lightning as L

from lightning_varuna.hook_wrapping import restore_hooks, wrap_hook


class Counting(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def on_train_epoch_end(self) -> None:
        self.calls.append("class")


def around(hook, *args):  # noqa: ANN001, ANN002, ANN201
    return ["before", hook(*args)]


def test_a_hook_set_on_the_instance_is_the_one_wrapped_and_given_back():
    module = Counting()
    own = lambda: module.calls.append("instance")  # noqa: E731  (as a notebook patches a hook)
    module.on_train_epoch_end = own
    wrap_hook(module, "on_train_epoch_end", around)
    module.on_train_epoch_end()
    assert module.calls == ["instance"]
    restore_hooks(module)
    assert module.on_train_epoch_end is own


def test_a_class_hook_is_wrapped_and_given_back_even_if_wrapped_twice():
    module = Counting()
    wrap_hook(module, "on_train_epoch_end", around)
    wrap_hook(module, "on_train_epoch_end", around)
    assert module.on_train_epoch_end() == ["before", ["before", None]] and module.calls == ["class"]
    restore_hooks(module)
    assert "on_train_epoch_end" not in vars(module)
    module.on_train_epoch_end()
    assert module.calls == ["class", "class"]
