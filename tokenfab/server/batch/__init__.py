"""OpenAI's Files and Batches APIs: ``/v1/files`` (``files.py``, ``routes.py``), ``/v1/batches`` (``batches.py``,
``validation.py``, ``routes.py``), a background worker that runs batch lines through the online request handlers
at the lowest priority (``worker.py``, ``dispatch.py``), their metadata in a SQLAlchemy database (``db.py``), and
``tokenfab run-batch`` offline over the same line runner (``cli.py``)."""
