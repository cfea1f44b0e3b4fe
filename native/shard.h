/* Shard file format and its C reader/writer: mmap, checks, gather into caller buffers.
 *
 * The on-disk layout is described in docs/shard-format.md; the constants here
 * are the single source of truth for it. Every function that can fail takes a
 * shard_err_t and fills it with a message naming the file and the record or
 * byte offset, so the Python layer can raise it unchanged.
 */
#ifndef NATIVE_SHARD_H
#define NATIVE_SHARD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHARD_MAGIC "MPSHARD\0"
#define SHARD_END_MAGIC "MPSHEND\0"
#define SHARD_VERSION 1u
#define SHARD_HEADER_SIZE 64u
#define SHARD_FIELD_SIZE 128u
#define SHARD_INDEX_ENTRY_SIZE 16u
#define SHARD_TRAILER_SIZE 32u
#define SHARD_DATA_ALIGN 64u
#define SHARD_MAX_FIELDS 64u
#define SHARD_MAX_NDIM 8u
#define SHARD_NAME_LEN 40u

/* Element types, stored as one byte in the field table. */
enum shard_dtype {
    SHARD_U8 = 1, SHARD_I8 = 2, SHARD_U16 = 3, SHARD_I16 = 4,
    SHARD_U32 = 5, SHARD_I32 = 6, SHARD_U64 = 7, SHARD_I64 = 8,
    SHARD_F16 = 9, SHARD_F32 = 10, SHARD_F64 = 11, SHARD_BOOL = 12
};

/* Error codes; SHARD_OK is zero so `if (rc)` tests for failure. */
enum shard_code {
    SHARD_OK = 0,
    SHARD_E_IO,        /* open/read/write/mmap failed (errno in the message) */
    SHARD_E_TRUNCATED, /* file shorter than its header or trailer says */
    SHARD_E_MAGIC,     /* not a shard file, or the trailer is missing */
    SHARD_E_VERSION,   /* written by a newer format version */
    SHARD_E_HEADER,    /* header or field table inconsistent or corrupt */
    SHARD_E_INDEX,     /* index offsets out of file, unsorted or overlapping */
    SHARD_E_CHECKSUM,  /* a record's CRC32C does not match */
    SHARD_E_EMPTY,     /* shard holds no records */
    SHARD_E_RANGE,     /* read() asked for a record that does not exist */
    SHARD_E_ARG        /* caller error: bad schema, bad buffer */
};

typedef struct {
    int code;
    int64_t record;  /* record number involved, or -1 */
    int64_t offset;  /* byte offset in the file involved, or -1 */
    char msg[512];
} shard_err_t;

typedef struct {
    char name[SHARD_NAME_LEN];
    uint8_t dtype;
    uint8_t ndim;
    uint64_t shape[SHARD_MAX_NDIM];
    uint64_t offset; /* byte offset of the field inside a record */
    uint64_t size;   /* bytes per record for this field */
} shard_field_t;

/* Verification policy for record checksums. */
enum shard_verify {
    SHARD_VERIFY_NEVER = 0,  /* trust the bytes (after open-time structure checks) */
    SHARD_VERIFY_FIRST = 1,  /* check each record the first time this reader reads it */
    SHARD_VERIFY_ALWAYS = 2  /* check on every read */
};

typedef struct shard shard_t;
typedef struct shard_writer shard_writer_t;

/* ---- checksums ---------------------------------------------------------- */
uint32_t shard_crc32c(uint32_t crc, const void *data, size_t len);
int shard_crc32c_hardware(void);
/* The table-driven CRC32C, whatever the CPU (to test the hardware path against). */
uint32_t shard_crc32c_portable(uint32_t crc, const void *data, size_t len);

/* ---- dtypes and schema -------------------------------------------------- */
size_t shard_dtype_size(int dtype);
/* Fill offset/size of each field (natural alignment) and return the record size, 0 on error. */
uint64_t shard_layout(shard_field_t *fields, uint32_t n_fields, shard_err_t *err);

/* ---- reader ------------------------------------------------------------- */
shard_t *shard_open(const char *path, int verify, shard_err_t *err);
void shard_close(shard_t *s);
uint64_t shard_count(const shard_t *s);
uint64_t shard_record_size(const shard_t *s);
uint32_t shard_n_fields(const shard_t *s);
const shard_field_t *shard_field(const shard_t *s, uint32_t i);
const char *shard_path(const shard_t *s);
uint64_t shard_file_size(const shard_t *s);
uint64_t shard_data_offset(const shard_t *s);
/* File offset of record r (r < count; not checked). */
uint64_t shard_record_offset(const shard_t *s, uint64_t r);
/* Bytes of record data this reader has advised the kernel about (for tests/stats). */
uint64_t shard_released_bytes(const shard_t *s);
/* Touched-bytes budget after which the mapping is dropped with MADV_DONTNEED (0 = never). */
void shard_set_release_budget(shard_t *s, uint64_t bytes);
/* Read-ahead distance (bytes) advised with MADV_WILLNEED on in-order reads. */
void shard_set_readahead(shard_t *s, uint64_t bytes);

/* Check every record checksum; on mismatch report the first bad record. */
int shard_verify_all(shard_t *s, shard_err_t *err);
/* CRC32C of the whole file (the manifest's checksum). */
int shard_file_crc(shard_t *s, uint32_t *crc, shard_err_t *err);
/* Hint the kernel that these records are needed soon (MADV_WILLNEED). */
int shard_prefetch(shard_t *s, const int64_t *idx, size_t n, shard_err_t *err);

/*
 * Gather records idx[0..n) from a set of shards with identical layouts into
 * per-field output buffers: record k of the batch lands at outs[f] + k*size_f.
 * starts[j] is the global index of shard j's first record (starts[0] == 0),
 * total the number of records in the set. Safe to call without the GIL.
 */
int shard_gather(shard_t *const *shards, const uint64_t *starts, size_t n_shards,
                 uint64_t total, const int64_t *idx, size_t n, void *const *outs,
                 shard_err_t *err);

/* ---- writer ------------------------------------------------------------- */
/* Fields must already carry their layout (see shard_layout). Writes to a temp file. */
shard_writer_t *shard_writer_open(const char *path, const shard_field_t *fields,
                                  uint32_t n_fields, shard_err_t *err);
/* Append n records laid out back to back, each shard_writer_record_size bytes. */
int shard_writer_append(shard_writer_t *w, const void *records, size_t n, shard_err_t *err);
uint64_t shard_writer_record_size(const shard_writer_t *w);
uint64_t shard_writer_count(const shard_writer_t *w);
/* Write index, trailer and header, fsync, rename into place. Frees w. */
int shard_writer_close(shard_writer_t *w, shard_err_t *err);
/* Remove the temp file and free w; the target path is untouched. */
void shard_writer_abort(shard_writer_t *w);

#ifdef __cplusplus
}
#endif
#endif
