"""gRPC clients of the served generation model, run with .venv-triton's python (tritonclient[all] with its
protobuf lives there): reads {"url": ..., "jobs": [...]} as JSON on stdin, runs every job at once (a thread and
a client each) and prints one JSON list of results, in the jobs' order.

A job: {"kind": "stream" | "cancel" | "infer", "model", "prompt", "parameters", "stop"?, "after"?}
- stream: gRPC streaming infer with stream=true: every response, until the final one;
- cancel: the same, but the client stops its stream (cancelling the request) after ``after`` responses;
- infer: gRPC unary infer (the NAME-infer model), one response.
A result: {"text", "ids", "finish_reason", "responses", "error"}.
"""

import json
import queue
import sys
import threading

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def inputs(job, *, batch: bool):
    shape = [1, 1] if batch else [1]
    text = grpcclient.InferInput("text_input", shape, "BYTES")
    text.set_data_from_numpy(np.array([job["prompt"].encode()], dtype=np.object_).reshape(shape))
    found = [text]
    if not batch:
        stream = grpcclient.InferInput("stream", [1], "BOOL")
        stream.set_data_from_numpy(np.array([True]))
        found.append(stream)
    if job.get("stop"):
        stop = grpcclient.InferInput("stop", [1, len(job["stop"])] if batch else [len(job["stop"])], "BYTES")
        stop.set_data_from_numpy(np.array([s.encode() for s in job["stop"]], dtype=np.object_).reshape(stop.shape()))
        found.append(stop)
    return found


def run(url: str, job: dict) -> dict:
    client = grpcclient.InferenceServerClient(url)
    result = {"text": "", "ids": [], "finish_reason": None, "responses": 0, "error": None}
    try:
        if job["kind"] == "infer":
            response = client.infer(job["model"], inputs(job, batch=True), parameters=job.get("parameters") or None)
            result["text"] = response.as_numpy("text_output").reshape(-1)[0].decode()
            result["finish_reason"] = response.as_numpy("finish_reason").reshape(-1)[0].decode()
            result["responses"] = 1
            return result
        events = queue.Queue()
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        client.async_stream_infer(
            job["model"],
            inputs(job, batch=False),
            parameters=job.get("parameters") or None,
            enable_empty_final_response=True,
        )
        while True:
            response, error = events.get(timeout=120)
            if error is not None:
                result["error"] = str(error)
                break
            result["responses"] += 1
            text = response.as_numpy("text_output")
            if text is not None:
                result["text"] += text.reshape(-1)[0].decode()
                result["ids"] += response.as_numpy("output_ids").reshape(-1).tolist()
            reason = response.as_numpy("finish_reason")
            if reason is not None:
                result["finish_reason"] = reason.reshape(-1)[0].decode()
            if response.get_response().parameters["triton_final_response"].bool_param:
                break
            if job["kind"] == "cancel" and result["responses"] >= job["after"]:
                client.stop_stream(cancel_requests=True)
                result["finish_reason"] = "client cancelled"
                break
        client.stop_stream()
    except InferenceServerException as err:
        result["error"] = str(err)
    finally:
        client.close()
    return result


def main() -> None:
    spec = json.load(sys.stdin)
    results = [None] * len(spec["jobs"])

    def work(index: int, job: dict) -> None:
        try:
            results[index] = run(spec["url"], job)
        except Exception as err:  # a result for every job, whatever went wrong
            results[index] = {"text": "", "ids": [], "finish_reason": None, "responses": 0, "error": repr(err)}

    threads = [threading.Thread(target=work, args=(i, job)) for i, job in enumerate(spec["jobs"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
