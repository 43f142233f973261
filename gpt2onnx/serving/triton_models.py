"""The Triton Python-backend models that ``deploy --target triton`` writes: their ``model.py`` is one import of a
class here, so what runs inside the server is gpt2onnx's own code (installed in the server's Python), never
code from the model folder.

- :class:`GenerateModel` (``NAME-generate``, decoupled): owns a :class:`~gpt2onnx.serving.engine.BatchingEngine`
  on the decoder files of its version folder, the shape of Triton's vLLM backend: ``execute`` hands each request
  to the engine and returns at once; the engine thread decodes every request together (continuous batching);
  a sender thread sends each request's responses and watches for clients that went away (their rows are
  dropped at the next step). Inputs ``text_input`` (one string), optional ``stream`` (bool: one response per
  token, else one response with the whole text) and ``stop`` (stop strings, a list); the decoding options of
  ``gpt2onnx generate`` as request parameters (:data:`PARAMETERS`; its speculative ones, by transformers'
  names, are refused: :data:`~gpt2onnx.serving.requests.SPECULATIVE_PARAMETERS`). Outputs ``text_output``
  (the text this response adds), ``output_ids`` (its token ids) and, in the last response, ``finish_reason`` (eos,
  stop, length).
  It answers ``/v2/models/NAME-generate/generate`` and ``generate_stream`` over HTTP, and gRPC's streaming infer.
- :class:`InferModel` (``NAME-infer``, not decoupled): Triton refuses the unary ``infer`` of HTTP and gRPC for a
  decoupled model, so this one forwards each request to ``NAME-generate`` (BLS, one engine for both) and answers
  with its whole text.

Errors are Triton errors: a bad request gets one response whose error is the one-line message gpt2onnx gives
(INVALID_ARG), and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpt2onnx.errors import BadInput, Gpt2OnnxError
from gpt2onnx.serving.requests import (  # noqa: F401 (PARAMETERS, GenerationRequest: this module's API too)
    PARAMETERS,
    GenerationRequest,
    PromptReader,
    parse_request,
    text,
)

log = logging.getLogger(__name__)

# model config parameters of NAME-generate (config.pbtxt, string values)
CONFIG_PARAMETERS = ("max_batch", "threads", "spinning", "verify_files")
# the one parameter NAME-infer forwards its request's parameters in, as JSON text: Triton's requests between
# models (BLS) carry only bool, int and str values, and a float (temperature) must reach the engine as sent
FORWARDED = "gpt2onnx_parameters"


def request_parameters(request) -> dict:
    """A request's parameters as the client sent them (those NAME-infer forwarded, unwrapped)."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except ValueError:
        raise BadInput("the request parameters are not JSON") from None
    if isinstance(parameters, dict) and FORWARDED in parameters:
        forwarded = parameters.pop(FORWARDED)
        if not isinstance(forwarded, str):
            raise BadInput(f"parameter {FORWARDED} must be JSON text (NAME-infer sends it)")
        try:
            inner = json.loads(forwarded)
        except ValueError:
            raise BadInput(f"parameter {FORWARDED} is not JSON text") from None
        if not isinstance(inner, dict):
            raise BadInput(f"parameter {FORWARDED} must be a JSON object")
        parameters = {**{k: v for k, v in parameters.items() if str(k).startswith("triton_")}, **inner}
    return parameters


def _config_parameters(model_config: dict) -> dict[str, str]:
    found = {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
    unknown = sorted(set(found) - set(CONFIG_PARAMETERS))
    if unknown:
        raise BadInput(
            f"config.pbtxt parameter {', '.join(unknown)} is unknown: the parameters are {CONFIG_PARAMETERS}"
        )
    return found


def _strings(tensor, *, max_bytes: int) -> list[str]:
    """A Triton STRING tensor as Python strings, each read as text is (UTF-8, at most ``max_bytes``)."""
    return [text(f"input {tensor.name()}", v, max_bytes=max_bytes) for v in tensor.as_numpy().reshape(-1).tolist()]


def _error(pb_utils, err: Exception):
    """A Triton error for an exception: INVALID_ARG for bad input, INTERNAL for the rest (one line)."""
    code = pb_utils.TritonError.INVALID_ARG if isinstance(err, BadInput) else pb_utils.TritonError.INTERNAL
    message = str(err) if isinstance(err, Gpt2OnnxError) else f"generation failed: {err}"
    return pb_utils.TritonError(message.splitlines()[0] if message else type(err).__name__, code)


@dataclass
class _Pending:
    """One request's response sender and what it has sent (the sender thread's side)."""

    sender: object
    stream: bool
    handle: object = None
    ids: list | None = None
    text: str = ""
    cancelled: bool = False


class GenerateModel:
    """``NAME-generate``: decoupled, continuous batching, streaming (module docstring)."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        from gpt2onnx.runtimes.providers import ProviderConfig
        from gpt2onnx.serving.engine import BatchingEngine

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise BadInput(f"model {args['model_name']} must be decoupled (model_transaction_policy): deploy it again")
        options = _config_parameters(config)
        folder = Path(args["model_repository"]) / args["model_version"]
        max_batch = _whole(options.get("max_batch", "16"), "max_batch")
        threads = _whole(options["threads"], "threads") if options.get("threads") else None
        spinning = options.get("spinning", "true").lower() != "false"
        if args.get("model_instance_kind") == "GPU":
            provider = ProviderConfig("cuda", device_id=int(args.get("model_instance_device_id") or 0))
        else:
            provider = ProviderConfig(threads=threads, spinning=spinning)
        verify = options.get("verify_files", "true").lower() != "false"
        self.engine = BatchingEngine.open(folder, max_batch=max_batch, provider=provider, verify_files=verify)
        if self.engine.tokenizer is None:
            raise BadInput(f"'{folder}' has no tokenizer files: the generation model takes text")
        self._outbox: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="gpt2onnx-triton-sender", daemon=True)
        self._sender.start()
        pb_utils.Logger.log_info(
            f"gpt2onnx: {args['model_name']} serves '{folder}' with up to {max_batch} requests decoded together"
            f" ({provider.name})"
        )

    def execute(self, requests):
        pb_utils = self.pb
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt_input = pb_utils.get_input_tensor_by_name(request, "text_input")
                if prompt_input is None:  # Triton refuses a request without a required input; this guards the config
                    raise BadInput("input text_input is missing: give the prompt as one string")
                texts = _strings(prompt_input, max_bytes=self.engine.reader.max_bytes)
                if len(texts) != 1:
                    raise BadInput(f"input text_input holds {len(texts)} strings: give one prompt per request")
                stream_input = pb_utils.get_input_tensor_by_name(request, "stream")
                stream = bool(stream_input.as_numpy().reshape(-1)[0]) if stream_input is not None else False
                stop_input = pb_utils.get_input_tensor_by_name(request, "stop")
                stop = _strings(stop_input, max_bytes=self.engine.reader.max_bytes) if stop_input is not None else []
                options = parse_request(request_parameters(request), stop)
                pending = _Pending(sender, stream, ids=[])
                pending.handle = self.engine.submit(
                    texts[0],
                    max_new_tokens=options.max_new_tokens,
                    sampling=options.sampling,
                    decoding=options.decoding,
                    on_event=lambda event, pending=pending: self._outbox.put((pending, event)),
                )
            except Exception as err:
                if not isinstance(err, Gpt2OnnxError):
                    pb_utils.Logger.log_error(f"gpt2onnx: request refused: {err!r}")
                sender.send(
                    pb_utils.InferenceResponse(error=_error(pb_utils, err)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
        return None

    def _send_loop(self) -> None:
        """Sends each event as a response (streaming) or the whole text at the end; a client that went away
        cancels its request, and a failed send harms no other request."""
        pb_utils = self.pb
        while True:
            item = self._outbox.get()
            if item is None:
                return
            pending, event = item
            if pending.cancelled and not event.last:
                continue  # the engine drops the request at its next step; its last event still closes it
            try:
                if not event.last and pending.sender.is_cancelled():
                    pending.cancelled = True
                    if pending.handle is not None:
                        pending.handle.cancel()
                    continue
                pending.ids.extend(event.token_ids)
                pending.text += event.text
                if event.last and pending.cancelled:  # Triton holds a request until its final flag comes
                    cancelled = pb_utils.TritonError("the request was cancelled", pb_utils.TritonError.CANCELLED)
                    pending.sender.send(
                        pb_utils.InferenceResponse(error=cancelled), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
                    )
                elif event.error is not None:
                    pending.sender.send(
                        pb_utils.InferenceResponse(error=_error(pb_utils, event.error)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                    )
                elif event.finish_reason == "cancelled":
                    cancelled = pb_utils.TritonError("the request was cancelled", pb_utils.TritonError.CANCELLED)
                    pending.sender.send(
                        pb_utils.InferenceResponse(error=cancelled), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
                    )
                elif pending.stream:
                    flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if event.last else 0
                    pending.sender.send(self._response(event.text, event.token_ids, event.finish_reason), flags=flags)
                elif event.last:
                    response = self._response(pending.text, pending.ids, event.finish_reason)
                    pending.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as err:  # the client is gone, or the server is stopping: drop this request only
                if not pending.cancelled:
                    pb_utils.Logger.log_warn(f"gpt2onnx: a response could not be sent ({err}); its request is dropped")
                pending.cancelled = True
                if pending.handle is not None:
                    pending.handle.cancel()
                if event.last:  # the final flag alone, so that Triton lets the request go
                    with contextlib.suppress(Exception):
                        pending.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _response(self, text: str, ids, finish_reason: str | None):
        pb_utils = self.pb
        outputs = [
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("output_ids", np.asarray(list(ids), dtype=np.int64)),
        ]
        if finish_reason is not None:
            outputs.append(pb_utils.Tensor("finish_reason", np.array([finish_reason.encode()], dtype=np.object_)))
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def finalize(self) -> None:
        self.engine.close()
        self._outbox.put(None)
        self._sender.join(30)


class InferModel:
    """``NAME-infer``: the unary ``infer`` of HTTP and gRPC, forwarded to ``NAME-generate`` (module docstring).
    Its requests are batched by Triton's dynamic batcher (a request may hold several prompts: its batch
    dimension); each prompt becomes one request of the generation model, all sent before any is awaited."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        parameters = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        self.target = parameters.get("generate_model")
        if not self.target:
            raise BadInput(f"model {args['model_name']} names no generate_model parameter: deploy it again")
        self.reader = _reader(Path(args["model_repository"]).parent / self.target / "1")

    async def execute(self, requests):
        import asyncio

        pb_utils = self.pb
        calls = []  # per request: its forwarded calls, or the error that refused it
        for request in requests:
            try:
                calls.append(self._forward(request))
            except Exception as err:
                calls.append(err)
        flat = [c for item in calls if not isinstance(item, Exception) for c in item]
        results = await asyncio.gather(*(c.async_exec(decoupled=True) for c in flat), return_exceptions=True)
        answers = iter(results)
        responses = []
        for item in calls:
            if isinstance(item, Exception):
                responses.append(pb_utils.InferenceResponse(error=_error(pb_utils, item)))
                continue
            texts, reasons, error = [], [], None
            for _ in item:
                result = next(answers)
                text, reason, failure = self._collect(result)
                texts.append(text)
                reasons.append(reason)
                error = error or failure
            if error is not None:
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            shape = (len(texts), 1)
            outputs = [
                pb_utils.Tensor("text_output", np.array([t.encode() for t in texts], dtype=np.object_).reshape(shape)),
                pb_utils.Tensor(
                    "finish_reason", np.array([r.encode() for r in reasons], dtype=np.object_).reshape(shape)
                ),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses

    def _forward(self, request) -> list:
        """The request's calls of the generation model, one per prompt, after every prompt and option is read as
        the generation model reads them (a refusal here is the client's 400, never a forwarded 500)."""
        pb_utils = self.pb
        prompt_input = pb_utils.get_input_tensor_by_name(request, "text_input")
        if prompt_input is None:
            raise BadInput("input text_input is missing: give the prompt as one string")
        prompts = _strings(prompt_input, max_bytes=self.reader.max_bytes)
        stop = pb_utils.get_input_tensor_by_name(request, "stop")
        # stop strings per prompt: the rows of [batch, n] (the batch dimension is the prompts')
        rows = [[]] * len(prompts) if stop is None else stop.as_numpy().reshape(len(prompts), -1).tolist()
        stops = [[text("stop string", s, max_bytes=self.reader.max_bytes) for s in row] for row in rows]
        parameters = request_parameters(request)
        for index, (prompt, row) in enumerate(zip(prompts, stops)):  # refuse here, before anything runs
            options = parse_request(parameters, row)
            name = "the prompt" if len(prompts) == 1 else f"prompt {index + 1} of {len(prompts)}"
            ids = self.reader.ids(prompt, name=name)
            self.reader.check_length(len(ids), options.max_new_tokens)
        return [
            pb_utils.InferenceRequest(
                model_name=self.target,
                requested_output_names=["text_output", "finish_reason"],
                inputs=[
                    pb_utils.Tensor("text_input", np.array([prompt.encode()], dtype=np.object_)),
                    *([pb_utils.Tensor("stop", np.array([s.encode() for s in row], dtype=np.object_))] if row else []),
                ],
                parameters={FORWARDED: json.dumps(parameters)},
            )
            for prompt, row in zip(prompts, stops)
        ]

    def _collect(self, result):
        """The text, finish reason and error of one forwarded call's responses."""
        pb_utils = self.pb
        if isinstance(result, Exception):
            return "", "", _error(pb_utils, result)
        text, reason = "", ""
        for response in result:
            if response.has_error():
                return "", "", pb_utils.TritonError(response.error().message(), response.error().code())
            output = pb_utils.get_output_tensor_by_name(response, "text_output")
            if output is not None:
                text += output.as_numpy().reshape(-1)[0].decode("utf-8")
            finish = pb_utils.get_output_tensor_by_name(response, "finish_reason")
            if finish is not None:
                reason = finish.as_numpy().reshape(-1)[0].decode()
        return text, reason, None


def _reader(folder: Path) -> PromptReader:
    """NAME-infer's reader of prompts: the generation model's tokenizer and context (that model checks the files
    against its manifest when it loads)."""
    from gpt2onnx.artifact.folder import CONFIG_FILE, read_json_file, read_n_positions
    from gpt2onnx.decoding.gpt2_tokenizer import load_gpt2_tokenizer

    # the configs only, never the graph: two instances of this model would each hold the weights otherwise
    vocab_size = read_json_file(folder / CONFIG_FILE, "config").get("vocab_size")
    vocab_size = vocab_size if isinstance(vocab_size, int) and not isinstance(vocab_size, bool) else None
    return PromptReader(load_gpt2_tokenizer(folder), read_n_positions(folder), vocab_size)


def _whole(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise BadInput(f"config.pbtxt parameter {name} must be a whole number, got {value!r}") from None
