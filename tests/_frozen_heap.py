"""Imported last by tests/_launch.py's forkserver, after the preloaded libraries: moves every object
they made into the garbage collector's permanent generation (``gc.freeze``).

[Note: a frozen heap for forked ranks]
A rank forked from the warm forkserver inherits the millions of objects torch, transformers and
Lightning made at import. Without this, each full collection in a rank (tests/workers/_worker.py's
``finish`` runs one, so that set-up models and their swap files go before ``os._exit``) walked all of
them: about 0.4 s of CPU per rank, and a write into each object's header, so the copy-on-write fork
copied those pages too. Frozen, they are never walked: a rank's collections see only the objects
it made itself. Nothing a rank makes is frozen, so what a test checks about collection (a torn
down model freed, a swap file removed) is unchanged; a preloaded object that became garbage in a
rank would no longer be collected there, which a short-lived rank does not notice.
"""

import gc

gc.collect()
gc.freeze()
