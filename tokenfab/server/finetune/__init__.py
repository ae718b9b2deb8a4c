"""OpenAI's fine-tuning jobs API, ``/v1/fine_tuning/jobs``: the request checks and the training file's check
(``validation.py``), the job objects, events and checkpoints in the Files/Batches database (``db.py``,
``jobs.py``), the worker that runs one job at a time in a subprocess of ``tokenfab.train`` (``worker.py``) and the
routes (``routes.py``). The server never imports ``tokenfab.train``: it talks to ``python -m tokenfab.train.job``
through a JSON spec file and the JSON progress lines the subprocess prints."""
