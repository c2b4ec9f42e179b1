"""The descriptor pool of sluice's protocol modules.

Not protobuf's default pool: tritonclient.grpc registers the same `inference.*` names there, and
a process that imports both (a test, a client embedding sluice) would fail with "duplicate
symbol 'inference.DataType'". The wire format is unchanged: only Python's registry differs."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
