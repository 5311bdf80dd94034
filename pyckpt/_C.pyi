# Type stubs of the private native module pyckpt._C.

__version__: str
zstd_version: str

# --- safetensors ---

MAX_SAFETENSORS_HEADER: int

def safetensors_dtype_bits(dtype: str) -> int: ...
def read_safetensors_header(path: str) -> dict[str, object]: ...
def parse_safetensors_header(
    json: bytes, file_size: int, origin: str = "<bytes>"
) -> dict[str, object]: ...
def safetensors_header(
    tensors: list[tuple[str, str, list[int]]], metadata: list[tuple[str, str]]
) -> tuple[bytes, list[tuple[str, int, int]], int]: ...
def check_tiling(
    name: str, shape: list[int], blocks: list[tuple[list[int], list[int], str]]
) -> None: ...

class StitchProgress:
    def __init__(self) -> None: ...
    @property
    def bytes(self) -> int: ...

def stitch(
    items: list[
        tuple[str, list[int], list[int], list[int], int, str, int, str, int, int, int, int, int]
    ],
    threads: int,
    task_bytes: int,
    input_mode: str,
    fsync: bool,
    progress: StitchProgress | None = None,
) -> dict[str, int]: ...
