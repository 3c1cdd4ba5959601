/* kvserve: what the libraries that use Intel AMX tiles share (cpu_ops.c, gemv.c): the tile
 * state request and the one tile configuration they use. */
#ifndef KVSERVE_AMX_H
#define KVSERVE_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} kv_tilecfg_t;

/* Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
 * 1 if granted. Per process; asking again is harmless. */
static int kv_amx_request(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

/* Load this thread's tile configuration: all 8 tiles 16 rows x 64 bytes (release with
 * _tile_release() when done). */
static inline __attribute__((target("amx-tile"))) void kv_amx_config(void) {
    kv_tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

#endif /* KVSERVE_AMX_H */
