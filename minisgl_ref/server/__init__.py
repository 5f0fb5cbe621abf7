"""The server: ``python -m minisgl_ref serve`` (chapter 10).

Four kinds of process, as in SGLang and Mini-SGLang, connected by ZeroMQ sockets that carry small msgpack-encoded
dataclasses (:mod:`minisgl_ref.server.messages`)::

    HTTP client ──> API server (main process: FastAPI + uvicorn + TokenizerManager)
                      │  GenerateReqInput / AbortReq / RpcReq            ▲ BatchStrOut (text deltas + ids)
                      ▼                                                  │ RpcResp
                    scheduler (one per TP rank; rank 0 only here) ── BatchTokenOut ──> detokenizer
                    runs Engine.step() in a loop                         (IncrementalDetokenizer per request)

* :mod:`~minisgl_ref.server.launch` starts the children with ``multiprocessing`` (spawn), waits until the model is
  loaded, serves, and stops everything on Ctrl-C / SIGTERM or when a child dies.
* :mod:`~minisgl_ref.server.tokenizer_manager` lives in the API process: it turns text into ids, sends requests
  to the scheduler, routes outputs back to the waiting HTTP handlers and aborts requests whose client left.
* :mod:`~minisgl_ref.server.scheduler_process` owns the :class:`~minisgl_ref.engine.engine.Engine`.
* :mod:`~minisgl_ref.server.detokenizer_process` turns token ids into streamed text.
* :mod:`~minisgl_ref.server.http_server` holds the OpenAI-compatible and SGLang-native endpoints
  (:mod:`~minisgl_ref.server.responses` adds OpenAI's Responses API on top of the chat route's code);
  :mod:`~minisgl_ref.server.protocol` their request schemas and error bodies; :mod:`~minisgl_ref.server.metrics`
  the Prometheus metrics; :mod:`~minisgl_ref.server.shell` the ``--shell`` chat.
"""
