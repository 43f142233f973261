"""Parse a Triton config.pbtxt with Triton's own schema (tritonclient's model_config_pb2; run with .venv-genai's
python, where tritonclient[grpc] lives with its protobuf) and print it as JSON. Unknown fields fail the parse."""

import json
import sys

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

config = text_format.Parse(open(sys.argv[1]).read(), model_config_pb2.ModelConfig())
name_of = model_config_pb2.DataType.Name
print(
    json.dumps(
        {
            "name": config.name,
            "platform": config.platform,
            "max_batch_size": config.max_batch_size,
            "inputs": [{"name": t.name, "data_type": name_of(t.data_type), "dims": list(t.dims)} for t in config.input],
            "outputs": [
                {"name": t.name, "data_type": name_of(t.data_type), "dims": list(t.dims)} for t in config.output
            ],
            "instance_kinds": [model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind) for g in config.instance_group],
        }
    )
)
