"""BoundedMemo: a thread-safe memo of bounded size, for a process's small memos."""
from __future__ import annotations

import threading
from collections import OrderedDict


class BoundedMemo:
    """A thread-safe memo of at most `max_entries` answers, least recently used dropped first.

    For the process's small memos (traced score_mods, support answers, logged reasons): each
    stays bounded however many distinct questions a long-running process asks. `compute` runs
    outside the lock, so two threads asking the same new question may both compute it; the
    answers are equal, and the first one stored is kept.
    """

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._answers: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, question, default=None):
        with self._lock:
            if question not in self._answers:
                return default
            self._answers.move_to_end(question)
            return self._answers[question]

    def put(self, question, answer) -> None:
        with self._lock:
            self._put_locked(question, answer)

    def add(self, question) -> bool:
        """Remember `question`; True when it was new (for "do this once" memos)."""
        with self._lock:
            new = question not in self._answers
            self._put_locked(question, True)
            return new

    def _put_locked(self, question, answer) -> None:
        self._answers.setdefault(question, answer)
        self._answers.move_to_end(question)
        while len(self._answers) > self.max_entries:
            self._answers.popitem(last=False)

    def get_or_compute(self, question, compute):
        missing = object()
        answer = self.get(question, missing)
        if answer is missing:
            computed = compute()
            with self._lock:
                self._put_locked(question, computed)
                answer = self._answers[question]
        return answer

    def __len__(self) -> int:
        with self._lock:
            return len(self._answers)
