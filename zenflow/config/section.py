"""What every block of the DeepSpeed JSON config is (zenflow/config/schema.py holds the whole
config, zero_sections.py and scheduler_sections.py the larger blocks): a pydantic model that
refuses unknown keys and lists the keys it accepts without effect.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config block: unknown keys are errors; `_ignored` lists keys accepted but unused."""

    model_config = ConfigDict(extra="forbid", validate_default=True)
    _ignored: tuple[str, ...] = ()

    def ignored_keys(self, prefix: str = "") -> list[str]:
        """Dotted paths of keys that were given but have no effect here."""
        out = [f"{prefix}{k}" for k in self._ignored if k in self.model_fields_set]
        for name in self.model_fields_set:
            value = getattr(self, name)
            if isinstance(value, Section):
                out += value.ignored_keys(f"{prefix}{name}.")
        return out
