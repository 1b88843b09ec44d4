"""Tie-aware comparison of a speculative output with the plain one: the package's
hyspec.exactness, re-exported for the tests (one implementation, shared with `hyspec bench`)."""

from hyspec.exactness import TIE_EPSILON, Comparison, assert_same_or_tie, compare, first_difference

__all__ = ["TIE_EPSILON", "Comparison", "assert_same_or_tie", "compare", "first_difference"]
