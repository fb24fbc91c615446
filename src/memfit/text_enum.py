"""A closed set of names whose text is what memfit writes: reports, JSON, messages."""

import enum

__all__ = ["TextEnum"]


class TextEnum(str, enum.Enum):
    """A str enum whose str() and f-strings give the value ("device", not "Tier.DEVICE"), as enum.StrEnum
    does on Python 3.11+ (memfit supports 3.10); a member compares equal to its text, and JSON writes it."""

    __str__ = str.__str__
    __format__ = str.__format__
