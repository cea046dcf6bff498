"""The batch embedding job: ``elmo embed-file INPUT OUTPUT --model DIR`` (files in, vectors out, at any scale).

The input is cut into *shards* of ``--shard-lines`` consecutive lines. A shard is the unit of work, of sorting
and of commitment::

    scan INPUT once: decode and validate every line, count lines, hash the bytes, note each shard's byte range
    for every shard not committed yet (in order; or spread over Ray actors with --engine ray):
        read its lines -> tokens -> sort by length -> call groups -> runtime (batches under --runtime-batch-tokens)
        -> layers -> all / top / average / mix:TASK -> dtype -> shard file (written as *.tmp, fsynced, renamed)
        -> one JSON line appended to the committed-shards manifest        <- the commit point
    (reading + embedding run in a background thread, a couple of call groups ahead of the writing)
    finish: hdf5    -> assemble the shards into one file in AllenNLP's layout, rename it into place
            parquet -> write the final manifest, rename the shard directory into place

Everything lives in ``OUTPUT.partial/`` until that last rename, so OUTPUT never exists half-written. A job killed
at any point (SIGKILL included) and started again with the same arguments keeps the committed shards, deletes
its other files in ``OUTPUT.partial/`` and carries on; the finished output holds every input line exactly once.
The job removes or replaces only what it wrote (its ``_job.json``, the Parquet ``_manifest.json``, the hdf5 root
attribute mark it), and a job that fails before its first commit leaves nothing behind.
Memory is bounded by a few call groups (hdf5) or one shard (Parquet), whatever the input's size.

The embedding itself (:mod:`elmo.batch.pipeline`) is the same code for the local engine, the Ray engine
(:mod:`elmo.batch.ray_engine`) and remote mode (``--server``, through :mod:`elmo.client`). Imports no torch.

Modules, in the order the data flows: plan (input, shards, call groups) -> engines (local / remote) and ray_engine ->
pipeline (the shared loop) -> writers (shard files, finished output) ; options (the job's options and fingerprint) ;
jobdir (the job directory, resume) ; atomic (crash-safe files) ; layout (what to write) ; job (start to finish) ;
cli (``elmo embed-file``).
"""
