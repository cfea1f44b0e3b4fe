# cython: language_level=3, boundscheck=False, wraparound=False
"""Cython face of the C shard core: open, verify, gather with the GIL released, write."""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset, strncpy

cimport numpy as cnp

import numpy as np

from .errors import ShardError

cnp.import_array()


cdef extern from "shard.h" nogil:
    enum:
        SHARD_MAX_FIELDS
        SHARD_MAX_NDIM
        SHARD_NAME_LEN
        SHARD_VERIFY_NEVER
        SHARD_VERIFY_FIRST
        SHARD_VERIFY_ALWAYS
        SHARD_OK

    ctypedef struct shard_err_t:
        int code
        int64_t record
        int64_t offset
        char msg[512]

    ctypedef struct shard_field_t:
        char name[40]
        uint8_t dtype
        uint8_t ndim
        uint64_t shape[8]
        uint64_t offset
        uint64_t size

    ctypedef struct shard_t:
        pass

    ctypedef struct shard_writer_t:
        pass

    uint32_t shard_crc32c(uint32_t crc, const void *data, size_t len)
    int shard_crc32c_hardware()
    size_t shard_dtype_size(int dtype)
    uint64_t shard_layout(shard_field_t *fields, uint32_t n_fields, shard_err_t *err)

    shard_t *shard_open(const char *path, int verify, shard_err_t *err)
    void shard_close(shard_t *s)
    uint64_t shard_count(const shard_t *s)
    uint64_t shard_record_size(const shard_t *s)
    uint32_t shard_n_fields(const shard_t *s)
    const shard_field_t *shard_field(const shard_t *s, uint32_t i)
    uint64_t shard_file_size(const shard_t *s)
    uint64_t shard_data_offset(const shard_t *s)
    uint64_t shard_record_offset(const shard_t *s, uint64_t r)
    uint64_t shard_released_bytes(const shard_t *s)
    void shard_set_release_budget(shard_t *s, uint64_t bytes)
    void shard_set_readahead(shard_t *s, uint64_t bytes)
    int shard_verify_all(shard_t *s, shard_err_t *err)
    int shard_file_crc(shard_t *s, uint32_t *crc, shard_err_t *err)
    int shard_prefetch(shard_t *s, const int64_t *idx, size_t n, shard_err_t *err)
    int shard_gather(shard_t *const *shards, const uint64_t *starts, size_t n_shards,
                     uint64_t total, const int64_t *idx, size_t n, void *const *outs,
                     shard_err_t *err)

    shard_writer_t *shard_writer_open(const char *path, const shard_field_t *fields,
                                      uint32_t n_fields, shard_err_t *err)
    int shard_writer_append(shard_writer_t *w, const void *records, size_t n, shard_err_t *err)
    uint64_t shard_writer_record_size(const shard_writer_t *w)
    uint64_t shard_writer_count(const shard_writer_t *w)
    int shard_writer_close(shard_writer_t *w, shard_err_t *err)
    void shard_writer_abort(shard_writer_t *w)


VERIFY_MODES = {"never": SHARD_VERIFY_NEVER, "first": SHARD_VERIFY_FIRST,
                "always": SHARD_VERIFY_ALWAYS}
MAX_FIELDS = SHARD_MAX_FIELDS
MAX_NDIM = SHARD_MAX_NDIM
NAME_LEN = SHARD_NAME_LEN


cdef object _error(shard_err_t *err, str path=None):
    """Turn a C error into the ShardError the API promises."""
    msg = err.msg.decode("utf-8", "replace")
    rec = err.record if err.record >= 0 else None
    off = err.offset if err.offset >= 0 else None
    return ShardError(msg, path=path, record=rec, offset=off)


def crc32c(data, uint32_t crc=0) -> int:
    """CRC32C (Castagnoli) of a bytes-like object, continuing from `crc`."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef size_t n = view.shape[0]
    if n == 0:
        return crc
    with nogil:
        crc = shard_crc32c(crc, &view[0], n)
    return crc


def crc32c_hardware() -> bool:
    """True when CRC32C runs on the CPU's instruction (SSE4.2), not the table code."""
    return bool(shard_crc32c_hardware())


cdef int _fill_fields(list schema, shard_field_t *fields) except -1:
    """schema: list of (name, dtype_code, shape) -> C field table (layout not yet set)."""
    cdef int i, d
    memset(fields, 0, sizeof(shard_field_t) * SHARD_MAX_FIELDS)
    for i, (name, code, shape) in enumerate(schema):
        raw = name.encode("utf-8")
        if len(raw) >= SHARD_NAME_LEN:
            raise ValueError(f"field name {name!r} is longer than {SHARD_NAME_LEN - 1} bytes")
        strncpy(fields[i].name, raw, SHARD_NAME_LEN - 1)
        fields[i].dtype = code
        fields[i].ndim = len(shape)
        for d, dim in enumerate(shape):
            fields[i].shape[d] = dim
    return 0


def layout(list schema):
    """Byte layout of a schema: (record_size, [(offset, size), ...]); raises ValueError."""
    cdef shard_field_t fields[SHARD_MAX_FIELDS]
    cdef shard_err_t err
    if not 0 < len(schema) <= SHARD_MAX_FIELDS:
        raise ValueError(f"a schema needs 1..{SHARD_MAX_FIELDS} fields, got {len(schema)}")
    _fill_fields(schema, fields)
    cdef uint64_t rs = shard_layout(fields, len(schema), &err)
    if rs == 0:
        raise ValueError(err.msg.decode("utf-8", "replace"))
    return rs, [(fields[i].offset, fields[i].size) for i in range(len(schema))]


cdef class Shard:
    """One open, validated, memory-mapped shard file."""

    cdef shard_t *s
    cdef readonly str path

    def __cinit__(self, str path, str verify="first"):
        cdef shard_err_t err
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {sorted(VERIFY_MODES)}, got {verify!r}")
        cdef int mode = VERIFY_MODES[verify]
        raw = path.encode()
        cdef const char *cpath = raw
        self.path = path
        with nogil:
            self.s = shard_open(cpath, mode, &err)
        if self.s == NULL:
            raise _error(&err, path)

    def __dealloc__(self):
        if self.s != NULL:
            shard_close(self.s)
            self.s = NULL

    cdef shard_t *ptr(self) except NULL:
        if self.s == NULL:
            raise ShardError(f"{self.path}: shard is closed", path=self.path)
        return self.s

    def close(self):
        if self.s != NULL:
            shard_close(self.s)
            self.s = NULL

    @property
    def closed(self) -> bool:
        return self.s == NULL

    @property
    def count(self) -> int:
        return shard_count(self.ptr())

    @property
    def record_size(self) -> int:
        return shard_record_size(self.ptr())

    @property
    def file_size(self) -> int:
        return shard_file_size(self.ptr())

    @property
    def released_bytes(self) -> int:
        return shard_released_bytes(self.ptr())

    @property
    def data_offset(self) -> int:
        return shard_data_offset(self.ptr())

    def record_offset(self, uint64_t r) -> int:
        """File offset of record r."""
        cdef shard_t *s = self.ptr()
        if r >= shard_count(s):
            raise ShardError(f"{self.path}: record {r} is out of range", path=self.path, record=r)
        return shard_record_offset(s, r)

    def fields(self):
        """[(name, dtype_code, shape, offset, size)] as stored in the file."""
        cdef shard_t *s = self.ptr()
        cdef const shard_field_t *f
        out = []
        for i in range(shard_n_fields(s)):
            f = shard_field(s, i)
            name = f.name[:SHARD_NAME_LEN].split(b"\0", 1)[0].decode("utf-8", "replace")
            shape = tuple(int(f.shape[d]) for d in range(f.ndim))
            out.append((name, int(f.dtype), shape, int(f.offset), int(f.size)))
        return out

    def set_release_budget(self, uint64_t nbytes):
        shard_set_release_budget(self.ptr(), nbytes)

    def set_readahead(self, uint64_t nbytes):
        shard_set_readahead(self.ptr(), nbytes)

    def verify_all(self):
        cdef shard_err_t err
        cdef shard_t *s = self.ptr()
        cdef int rc
        with nogil:
            rc = shard_verify_all(s, &err)
        if rc:
            raise _error(&err, self.path)

    def file_crc(self) -> int:
        cdef shard_err_t err
        cdef uint32_t crc = 0
        cdef shard_t *s = self.ptr()
        with nogil:
            shard_file_crc(s, &crc, &err)
        return crc

    def prefetch(self, const int64_t[::1] idx):
        cdef shard_err_t err
        cdef shard_t *s = self.ptr()
        cdef int rc = 0
        if idx.shape[0]:
            with nogil:
                rc = shard_prefetch(s, &idx[0], idx.shape[0], &err)
        if rc:
            raise _error(&err, self.path)


cdef class ShardSet:
    """Shards with one layout, addressed by a global record index; gathers into buffers."""

    cdef shard_t **ptrs
    cdef uint64_t *starts
    cdef size_t n
    cdef readonly uint64_t total
    cdef readonly list shards
    cdef readonly str name
    cdef readonly list dtypes
    cdef uint32_t nf
    cdef int typenums[SHARD_MAX_FIELDS]
    cdef int ndims[SHARD_MAX_FIELDS]
    cdef cnp.npy_intp shapes[SHARD_MAX_FIELDS][SHARD_MAX_NDIM]

    def __cinit__(self, list shards, list dtypes, str name=""):
        """shards: open Shard objects (same layout, checked by the caller);
        dtypes: one numpy dtype per field, in field order."""
        cdef Shard sh
        if not shards:
            raise ShardError(f"{name}: a data set needs at least one shard", path=name)
        self.shards = list(shards)
        self.name = name
        self.n = len(shards)
        self.ptrs = <shard_t **>malloc(self.n * sizeof(shard_t *))
        self.starts = <uint64_t *>malloc(self.n * sizeof(uint64_t))
        if self.ptrs == NULL or self.starts == NULL:
            raise MemoryError()
        cdef uint64_t total = 0
        for i, sh in enumerate(shards):
            self.ptrs[i] = sh.ptr()
            self.starts[i] = total
            total += shard_count(self.ptrs[i])
        self.total = total
        fields = (<Shard>shards[0]).fields()
        for sh in shards[1:]:
            # Field offsets may differ between writers; names, types and shapes may not.
            other = sh.fields()
            if [f[:3] for f in other] != [f[:3] for f in fields]:
                raise ShardError(f"{sh.path}: schema mismatch with {shards[0].path}",
                                 path=sh.path)
        self.nf = len(fields)
        self.dtypes = [np.dtype(d) for d in dtypes]
        if len(dtypes) != self.nf:
            raise ValueError("one dtype per field is needed")
        for f, (fname, code, shape, off, size) in enumerate(fields):
            self.typenums[f] = np.dtype(dtypes[f]).num
            self.ndims[f] = len(shape)
            for d, dim in enumerate(shape):
                self.shapes[f][d] = dim

    def __dealloc__(self):
        free(self.ptrs)
        free(self.starts)

    def gather(self, cnp.ndarray idx, list outs):
        """Copy records idx (1-D C-contiguous int64) into outs (one C-contiguous array per
        field, rows >= len(idx)). Allocates nothing: no buffer, no memoryview."""
        cdef shard_err_t err
        cdef void *outs_c[SHARD_MAX_FIELDS]  # on the stack: other threads gather too
        cdef uint32_t f
        if (cnp.PyArray_TYPE(idx) != cnp.NPY_INT64 or cnp.PyArray_NDIM(idx) != 1
                or not cnp.PyArray_IS_C_CONTIGUOUS(idx)):
            raise ShardError(f"{self.name}: indices must be a 1-D C-contiguous int64 array",
                             path=self.name)
        cdef size_t n = <size_t>cnp.PyArray_DIM(idx, 0)
        cdef const int64_t *ip = <const int64_t *>cnp.PyArray_DATA(idx)
        cdef int d, rc
        cdef cnp.ndarray a
        if <uint32_t>len(outs) != self.nf:
            raise ShardError(f"{self.name}: need {self.nf} output arrays, got {len(outs)}",
                             path=self.name)
        for f in range(self.nf):
            a = outs[f]
            if cnp.PyArray_TYPE(a) != self.typenums[f]:
                raise ShardError(f"{self.name}: output {f} has dtype {(<object>a).dtype}, the field needs "
                                 f"{self.dtypes[f]}",
                                 path=self.name)
            if cnp.PyArray_NDIM(a) != self.ndims[f] + 1:
                raise ShardError(f"{self.name}: output {f} has shape {(<object>a).shape}, expected "
                                 f"(rows,) + {self.field_shape(f)}", path=self.name)
            for d in range(self.ndims[f]):
                if cnp.PyArray_DIM(a, d + 1) != self.shapes[f][d]:
                    raise ShardError(f"{self.name}: output {f} has shape {(<object>a).shape}, expected "
                                     f"(rows,) + {self.field_shape(f)}", path=self.name)
            if <size_t>cnp.PyArray_DIM(a, 0) < n:
                raise ShardError(f"{self.name}: output {f} has {(<object>a).shape[0]} rows, the batch "
                                 f"needs {n}", path=self.name)
            if not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISWRITEABLE(a):
                raise ShardError(f"{self.name}: output {f} must be C-contiguous and writeable",
                                 path=self.name)
            outs_c[f] = cnp.PyArray_DATA(a)
        if n == 0:
            return
        with nogil:
            rc = shard_gather(self.ptrs, self.starts, self.n, self.total, ip, n,
                              outs_c, &err)
        if rc:
            exc = _error(&err, self.name)
            if self.n > 1 and str(exc).startswith("dataset:"):
                # The C core knows shards, not the data set's directory: name it.
                exc = ShardError(self.name + str(exc)[len("dataset"):], path=self.name,
                                 record=exc.record, offset=exc.offset)
            raise exc

    def field_shape(self, int f):
        return tuple(int(self.shapes[f][d]) for d in range(self.ndims[f]))

    def locate(self, int64_t i):
        """(shard number, record within it) for a global index."""
        if i < 0 or <uint64_t>i >= self.total:
            raise ShardError(f"{self.name}: record index {i} is out of range: the data holds "
                             f"{self.total} records", path=self.name, record=i)
        lo = 0
        for j in range(self.n):
            if self.starts[j] <= <uint64_t>i:
                lo = j
        return lo, i - self.starts[lo]


cdef class Writer:
    """Streams records into a temp file; close() makes it appear atomically at `path`."""

    cdef shard_writer_t *w
    cdef readonly str path
    cdef readonly uint64_t record_size

    def __cinit__(self, str path, list schema):
        cdef shard_field_t fields[SHARD_MAX_FIELDS]
        cdef shard_err_t err
        if not 0 < len(schema) <= SHARD_MAX_FIELDS:
            raise ValueError(f"a schema needs 1..{SHARD_MAX_FIELDS} fields, got {len(schema)}")
        _fill_fields(schema, fields)
        if shard_layout(fields, len(schema), &err) == 0:
            raise ValueError(err.msg.decode("utf-8", "replace"))
        raw = path.encode()
        self.path = path
        self.w = shard_writer_open(raw, fields, len(schema), &err)
        if self.w == NULL:
            raise _error(&err, path)
        self.record_size = shard_writer_record_size(self.w)

    def __dealloc__(self):
        if self.w != NULL:
            shard_writer_abort(self.w)
            self.w = NULL

    @property
    def count(self) -> int:
        return shard_writer_count(self.w) if self.w != NULL else 0

    def append(self, const unsigned char[::1] records, size_t n):
        """Append n records laid out back to back (n * record_size bytes)."""
        cdef shard_err_t err
        cdef int rc
        if self.w == NULL:
            raise ShardError(f"{self.path}: writer is closed", path=self.path)
        if <size_t>records.shape[0] != n * self.record_size:
            raise ValueError(f"{n} records need {n * self.record_size} bytes, got "
                             f"{records.shape[0]}")
        if n == 0:
            return
        with nogil:
            rc = shard_writer_append(self.w, &records[0], n, &err)
        if rc:
            raise _error(&err, self.path)

    def close(self):
        cdef shard_err_t err
        cdef int rc
        if self.w == NULL:
            return
        cdef shard_writer_t *w = self.w
        self.w = NULL
        with nogil:
            rc = shard_writer_close(w, &err)
        if rc:
            raise _error(&err, self.path)

    def abort(self):
        if self.w != NULL:
            shard_writer_abort(self.w)
            self.w = NULL
