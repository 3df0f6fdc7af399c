"""What every config group shares: :class:`ConfigError` and the checks that raise it
naming the field (choices, signs, fields refused together), and :class:`ConfigGroup`,
the base of the groups :class:`jmegatron.config.JMegatronConfig` is composed of."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Iterable


class ConfigError(ValueError):
    """A config field has a bad value. The message names the field and the fix."""


class ConfigGroup:
    """Base of the config groups (frozen dataclasses of fields with Megatron-LM's names).

    A group's fields are declared once, in its class; :class:`jmegatron.config.JMegatronConfig`
    inherits every group, so a run's config has each field under its own name. A group's
    ``CHOICES`` (field -> allowed values) are checked by :func:`check_choices`."""

    CHOICES = {}

    @classmethod
    def of(cls, cfg: Any):
        """This group's fields of ``cfg`` (a run's config or any object with the fields), as
        an instance of the group. Raises AttributeError for a field ``cfg`` lacks."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


def check_choices(cfg: Any, choices: dict) -> None:
    """Raise ConfigError for the first field of ``choices`` (name -> allowed values) whose
    value in ``cfg`` is not allowed, with the closest allowed value suggested."""
    for name, allowed in choices.items():
        value = getattr(cfg, name)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), allowed, 1, 0.5)
            hint = f' Did you mean "{close[0]}"?' if close else ""
            raise ConfigError(f"config.{name}={value!r} is not one of {list(allowed)}.{hint}")


def check_positive(cfg: Any, names: Iterable[str]) -> None:
    """Raise ConfigError ``config.<name>=<value> must be > 0.`` for the first of ``names``
    whose value in ``cfg`` is not."""
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"config.{name}={getattr(cfg, name)} must be > 0.")


def check_nonnegative(cfg: Any, names: Iterable[str]) -> None:
    """Raise ConfigError ``config.<name>=<value> must be >= 0.`` for the first of ``names``
    whose value in ``cfg`` is set (not None) and negative."""
    for name in names:
        if getattr(cfg, name) is not None and getattr(cfg, name) < 0:
            raise ConfigError(f"config.{name}={getattr(cfg, name)} must be >= 0.")


def refuse_with(cfg: Any, feature: str, refused: dict, why: str, fix: str) -> None:
    """ConfigError for the first field of ``refused`` (name -> whether its value in ``cfg``
    is refused) that is: ``config.<feature> with <name>=<value> is not built (<why>); <fix>``
    (``{name}`` in ``fix`` becomes the field's name)."""
    for name, bad in refused.items():
        if bad:
            raise ConfigError(f"config.{feature} with {name}={getattr(cfg, name)!r} is not built ({why}); "
                              + fix.format(name=name))


def check_unset(cfg: Any, names: Iterable[str], message: str) -> None:
    """Raise ConfigError ``message.format(name=..., value=...)`` for the first of ``names``
    whose value in ``cfg`` is set (not None): fields that need another one."""
    for name in names:
        value = getattr(cfg, name)
        if value is not None:
            raise ConfigError(message.format(name=name, value=value))
