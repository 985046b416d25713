"""Cold sequential read bandwidth of the disk holding a checkpoint, read the way a streamed pass reads it; cached
per filesystem.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from batchrun.measure.cache import cached, store
from batchrun.plan import Bandwidth, format_bytes

READ_CHUNK_BYTES = 16 << 20  # large sequential reads, like a streamer reading a layer


# Reads smaller than this measure latency and caches more than bandwidth: reported, but not cached as the
# figure for the whole filesystem.
MIN_CACHED_SAMPLE_BYTES = 64 << 20


def measure_read_bandwidth(path: Path, max_bytes: int = 1 << 30) -> Bandwidth:
    """Cold sequential read rate of the storage holding `path` (a checkpoint directory: its weight files in order),
    read the way the streamer reads a layer (loader.py): large positional reads through the page cache, each file's
    pages dropped before it is read and each chunk's after. The kernel's readahead keeps several requests in flight;
    O_DIRECT at one request at a time reads markedly slower on the same disk (docs/performance.md#reading-a-layer),
    so it would understate what a pass can read. Cached per filesystem."""
    files = _weight_files(Path(path))
    seconds, read, files_read = _timed_reads_after_dropping_cache(files, max_bytes)
    if read == 0:
        raise ValueError(f"{path}: empty file(s), nothing to measure")
    where = str(files[0]) if files_read == 1 else f"{files_read} files from {files[0].parent}"
    how = f"sequential reads after posix_fadvise(DONTNEED) of {format_bytes(read)} ({where})"
    if not hasattr(os, "posix_fadvise"):
        how += " (this platform cannot drop cached pages: the rate may include them)"
    bytes_per_s = read / max(seconds, 1e-9)
    if read >= MIN_CACHED_SAMPLE_BYTES:
        store("bandwidth", str(os.stat(files[0]).st_dev), {"bytes_per_s": bytes_per_s, "how": how,
                                                             "bytes_read": read})
    else:
        how += " (sample too small to cache for this filesystem)"
    return Bandwidth(bytes_per_s, "measured", how)


def cached_bandwidth(path: Path) -> Bandwidth | None:
    """The bandwidth measured earlier on the filesystem holding `path`, if any."""
    entry = cached("bandwidth", str(os.stat(path).st_dev))
    if entry is None:
        return None
    return Bandwidth(entry["bytes_per_s"], "measured", f"{entry['how']}, on {entry['measured_at'][:10]}")


def _weight_files(path: Path) -> list[Path]:
    """A checkpoint's safetensors shards in name order (the order a pass reads them), or the one file given."""
    if not path.is_dir():
        return [path]
    files = sorted(path.glob("*.safetensors")) or sorted(p for p in path.iterdir() if p.is_file())
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise ValueError(f"{path}: no files to measure")
    return files


def _drop_cached(descriptor: int, offset: int = 0, length: int = 0) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(descriptor, offset, length, os.POSIX_FADV_DONTNEED)


def _timed_reads_after_dropping_cache(files: list[Path], max_bytes: int) -> tuple[float, int, int]:
    """(seconds, bytes read, files read from)."""
    buffer = memoryview(bytearray(READ_CHUNK_BYTES))
    descriptors = [os.open(file, os.O_RDONLY) for file in files]
    try:
        for descriptor in descriptors:  # before the clock starts: nothing read is already in memory
            _drop_cached(descriptor)
        done = files_read = 0
        start = time.perf_counter()
        for descriptor in descriptors:
            if done >= max_bytes:
                break
            offset = 0
            files_read += 1
            while done < max_bytes:
                count = os.preadv(descriptor, [buffer[:min(READ_CHUNK_BYTES, max_bytes - done)]], offset)
                if count == 0:  # end of this file
                    break
                _drop_cached(descriptor, offset, count)
                offset += count
                done += count
        return time.perf_counter() - start, done, files_read
    finally:
        for descriptor in descriptors:
            os.close(descriptor)
