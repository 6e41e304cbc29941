"""How the sections measure: repeats, windows and statistics (``timing``), arms side by side
(``lockstep``), each benchmark's size (``plan``), the machine (``machine``) and the
markdown around the sections (``report``)."""
