"""Measurements outside ``make bench``: a revision's trainer arms beside the working tree's
(``versus``, ``make bench-versus``) and instructions per iteration under callgrind
(``instructions``, ``make bench-instructions``)."""
