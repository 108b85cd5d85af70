"""Global names: which name in the whole model each tensor of a stage module has.

Why: a checkpoint that only knows ``stage 2's "0.weight"`` can only be loaded into a pipeline
that cuts the model at the same layers. A checkpoint that knows ``"layers.5.weight"`` can be
loaded into any cut of the same model, exported as the plain model's ``state_dict``, and
started from one (docs/DESIGN.md, "Checkpoints across layouts"). So every stage module may
carry a *naming*: the rule that turns its own ``state_dict`` keys into the model's.

Who declares it:

* :func:`engine.partition.split_sequential` (and with it ``Pipeline(seq, balance=...)``, the
  partitioner and the command line): its stages keep the model's layer names, so the naming
  is the identity;
* :func:`engine.integrations.hf.split_causal_lm`: each stage maps its ``tok``/``blocks.i``/``head`` to the
  Hugging Face model's ``transformer.wte``/``transformer.h.j``/``lm_head``;
* the user, for hand-made stages and stage factories: :func:`named_stage`.

A pipeline of undeclared hand-made stages keeps working and saves as before; only a load
into another layout, an export and a start from a plain ``state_dict`` need the names, and
they refuse with a message that shows how to declare them.

The registry holds modules weakly (like :mod:`engine.runtime.tensor_parallel`'s):
nothing is written onto the user's modules. This module imports torch only.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

__all__ = ["named_stage", "declare", "naming_of", "module_names", "carry_naming", "Naming",
           "NamesError", "HOW_TO_DECLARE"]

#: what a refusal says when a stage has no names
HOW_TO_DECLARE = (
    "build the pipeline from one model (an nn.Sequential with balance=, or "
    "engine.integrations.hf.split_causal_lm), or declare each stage's names in the whole model with "
    "engine.named_stage(stage_or_factory, 'prefix') or engine.named_stage(stage_or_factory, "
    "{'local.module': 'model.module', ...})"
)


class NamesError(ValueError):
    """A naming that does not cover a stage's tensors, or maps two of them to one name."""


class Naming:
    """A stage's rule from its ``state_dict`` keys to the whole model's names.

    ``rule`` is a prefix (``"layers.3"``: ``"0.weight"`` becomes ``"layers.3.0.weight"``;
    ``""``: the stage's names are the model's), a mapping from the stage's module paths to
    the model's (the longest matching path wins; ``""`` matches everything), or a function
    ``local_name -> model_name``."""

    def __init__(self, rule: str | Mapping[str, str] | Callable[[str], str]) -> None:
        if isinstance(rule, str):
            self.rule: Any = rule
        elif isinstance(rule, Mapping):
            bad = [k for k, v in rule.items() if not isinstance(k, str) or not isinstance(v, str)]
            if bad:
                raise TypeError(f"named_stage: names maps module paths to module paths (str -> "
                                f"str); {bad!r} are not")
            self.rule = dict(rule)
        elif callable(rule):
            self.rule = rule
        else:
            raise TypeError(
                f"named_stage: names={rule!r} must be a prefix (str), a mapping of the stage's "
                "module paths to the model's, or a function local_name -> model_name"
            )

    def __call__(self, local: str) -> str | None:
        rule = self.rule
        if isinstance(rule, str):
            return _join(rule, local)
        if isinstance(rule, dict):
            for key in sorted(rule, key=len, reverse=True):
                if key == "":
                    return _join(rule[key], local)
                if local == key:
                    return rule[key]
                if local.startswith(key + "."):
                    return _join(rule[key], local[len(key) + 1:])
            return None
        out = rule(local)
        if not isinstance(out, str):
            raise NamesError(f"the naming function returned {out!r} for {local!r}; it must "
                             "return the tensor's name in the whole model (a str)")
        return out

    def describe(self) -> str:
        rule = self.rule
        if isinstance(rule, str):
            return f"prefix {rule!r}" if rule else "the model's own names"
        if isinstance(rule, dict):
            return f"names {rule!r}"
        return f"the function {getattr(rule, '__name__', repr(rule))}"


def _join(prefix: str, rest: str) -> str:
    if not prefix:
        return rest
    return f"{prefix}.{rest}" if rest else prefix


_NAMING: weakref.WeakKeyDictionary[nn.Module, Naming] = weakref.WeakKeyDictionary()


def declare(module: nn.Module, names: str | Mapping[str, str] | Callable[[str], str] | Naming) -> nn.Module:
    """Record ``module``'s naming (see :class:`Naming`); returns ``module``."""
    _NAMING[module] = names if isinstance(names, Naming) else Naming(names)
    return module


def naming_of(module: nn.Module) -> Naming | None:
    """The naming declared for ``module`` (None: undeclared)."""
    return _NAMING.get(module)


def carry_naming(old: nn.Module, new: nn.Module) -> nn.Module:
    """``new`` replaces ``old`` as a stage module (e.g. a converted BatchNorm): same names."""
    found = _NAMING.get(old)
    if found is not None and new is not old:
        _NAMING[new] = found
    return new


def module_names(module: nn.Module, keys: list[str] | None = None) -> dict[str, str] | None:
    """``{state_dict key: name in the whole model}`` for every key of ``module.state_dict()``
    (or of ``keys``); None when the module declares no naming. Raises :class:`NamesError`
    when the naming leaves a key out or gives two keys that are not one tensor the same name."""
    naming = _NAMING.get(module)
    if naming is None:
        return None
    sd = module.state_dict(keep_vars=True)
    keys = list(sd) if keys is None else keys
    out: dict[str, str] = {}
    for k in keys:
        g = naming(k)
        if g is None:
            raise NamesError(
                f"{k!r} has no name in the model: its declared {naming.describe()} covers no "
                f"prefix of it; add its module path to the names"
            )
        out[k] = g
    seen: dict[str, str] = {}
    for k, g in out.items():
        other = seen.setdefault(g, k)
        if other != k and not (k in sd and other in sd and sd[k] is sd[other]):
            raise NamesError(f"{other!r} and {k!r} both get the model name {g!r} from the "
                             f"declared {naming.describe()}; give each tensor its own name")
    return out


class NamedStageFactory:
    """A stage factory whose modules carry a naming (what :func:`named_stage` returns for a
    factory). Accepts ``tp_mesh`` exactly when the factory it wraps does, so a mesh pipeline
    hands it the tensor-parallel sub-mesh as before."""

    def __init__(self, factory: Callable[..., nn.Module], naming: Naming) -> None:
        self.factory = factory
        self.naming = naming
        self.__name__ = getattr(factory, "__name__", type(factory).__name__)
        try:
            self.__signature__ = inspect.signature(factory)
        except (TypeError, ValueError):
            self.__signature__ = inspect.Signature()

    def __call__(self, *args: Any, **kwargs: Any) -> nn.Module:
        module = self.factory(*args, **kwargs)
        if isinstance(module, nn.Module):  # (anything else: the builder's own error)
            declare(module, self.naming)
        return module

    def __repr__(self) -> str:
        return f"named_stage({self.__name__}, {self.naming.describe()})"


def named_stage(stage: Any, names: str | Mapping[str, str] | Callable[[str], str] = "") -> Any:
    """Declare which names a stage's tensors have in the whole model.

    ``stage`` is a stage module or a stage factory ``() -> nn.Module`` (one that takes
    ``tp_mesh`` keeps taking it); ``names`` is

    * a prefix: the stage module *is* the model's submodule at that path (``"encoder"``:
      the stage's ``"0.weight"`` is the model's ``"encoder.0.weight"``); ``""`` (the
      default): the stage's names already are the model's, e.g. a stage built as
      ``nn.Sequential(OrderedDict([("4", layer4), ("5", layer5)]))``;
    * a mapping from the stage's module paths to the model's (the longest match wins),
      e.g. ``{"embed": "tok_embeddings", "blocks.0": "layers.6", "blocks.1": "layers.7"}``;
    * a function ``local_name -> model_name``.

    Returns the module itself (declared), or a factory whose modules are declared. With the
    names declared, ``engine.load`` moves a checkpoint between layouts of the model,
    ``engine.export`` gives the model's ``state_dict`` and ``engine.load(pipe,
    "model.safetensors")`` starts from one.
    """
    naming = Naming(names)
    if isinstance(stage, nn.Module):
        return declare(stage, naming)
    if callable(stage):
        return NamedStageFactory(stage, naming)
    raise TypeError(f"named_stage: {type(stage).__name__} is neither a stage module nor a "
                    "factory () -> nn.Module")
