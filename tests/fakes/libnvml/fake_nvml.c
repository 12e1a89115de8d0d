/*
 * A small fake libnvidia-ml.so.1 for trainmon's tests: the real nvidia-ml-py (pynvml) ctypes
 * code calls into it exactly as it calls into NVIDIA's library.
 *
 * It implements only the functions trainmon's sampler (and nvidia-ml-py on its behalf) uses,
 * with the struct layouts of nvml.h (as mirrored by pynvml's ctypes structures). Anything
 * else is absent, so pynvml raises NVMLError_FunctionNotFound for it, as with an old driver.
 *
 * Driver branches: compile with -DNVML_BRANCH=470, 535, 550 or 570 (the default) to export the
 * symbols that branch's libnvidia-ml.so.1 has, among those trainmon calls. The sets come from
 * nvml.h of the CUDA release each branch ships with (R470: CUDA 11.4, R535: 12.2, R550: 12.4,
 * R570: 12.8), as kept in NVIDIA's go-nvml repository (gen/nvml/nvml.h, commits "Update
 * nvml.h to v11.4", "Bump to NVML version 12.2 / 12.4 / 12.8"): every DECLDIR declaration,
 * including the unversioned and older versions the NVML_NO_UNVERSIONED_FUNC_DEFS block keeps
 * exported. Among what trainmon calls, compared with R570:
 *
 *   R470 lacks nvmlDeviceGetComputeRunningProcesses_v3, nvmlDeviceGetMemoryInfo_v2,
 *        nvmlDeviceGetCurrentClocksEventReasons (it has ...ThrottleReasons, the same bits),
 *        the GPM functions (nvmlGpmQueryDeviceSupport, nvmlGpmSampleAlloc, nvmlGpmSampleGet,
 *        nvmlGpmSampleFree, nvmlGpmMetricsGet), nvmlDeviceGetTemperatureV; field ids end
 *        at NVML_FI_MAX 161.
 *   R535 lacks nvmlDeviceGetTemperatureV; field ids end at NVML_FI_MAX 197.
 *   R550 lacks nvmlDeviceGetTemperatureV; NVML_FI_MAX is 200 but 197/198 (the PCIe byte
 *        counters, NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES) are first defined in 12.5 (R555).
 *   R570 has them all (nvmlDeviceGetTemperatureV is new in 12.8). No function trainmon
 *        calls was removed between CUDA 11.4 and 13.0.
 *
 * Every branch exports the older versions too: nvmlDeviceGetComputeRunningProcesses (v1
 * struct) and _v2, nvmlDeviceGetPciInfo, _v2 and _v3, nvmlEventSetWait and _v2. A field id
 * past the branch's set answers NVML_ERROR_INVALID_ARGUMENT in its nvmlReturn (an assumption:
 * nvml.h does not say which code a driver gives an id it predates).
 *
 * More switches: -DNO_GPM, -DNO_FIELD_VALUES drop those functions; -DNO_PCI_INFO drops every
 * version of nvmlDeviceGetPciInfo.
 *
 * Devices are scripted by a text file named in FAKE_NVML_CONFIG, re-read whenever its
 * modification time changes, one "key=value" per line:
 *
 *   init_error=9                 nvmlInitWithFlags returns this code (9: driver not loaded)
 *   driver_version=550.54.15
 *   count=8
 *   gpu.N.name=NVIDIA H100 80GB HBM3
 *   gpu.N.uuid=GPU-...   gpu.N.bus_id=00000000:18:00.0   gpu.N.pci_device_id=0x233010DE
 *   gpu.N.<reading>=<number>     mem_total mem_used util_gpu util_mem power_mw power_limit_mw
 *                                energy_mj temp mem_temp sm_clock mem_clock sm_clock_max
 *                                mem_clock_max clock_reasons ecc_corr_vol ecc_unc_vol
 *                                ecc_corr_agg ecc_unc_agg remap_corr remap_unc remap_pending
 *                                remap_failure pcie_tx pcie_rx nvlink_tx_kib nvlink_rx_kib
 *                                gpm sm_active sm_occupancy tensor_active dram_active
 *   gpu.N.procs=PID:BYTES,PID:BYTES
 *   gpu.N.xid=79,48              XID events, each delivered once by nvmlEventSetWait(_v2)
 *   gpu.N.lost=1                 every call on this device returns 15 (GPU_IS_LOST)
 *   gpu.N.error.FUNCTION=CODE    that function (exact symbol) returns CODE for this device,
 *                                e.g. gpu.2.error.nvmlDeviceGetTemperature=3 (NOT_SUPPORTED)
 *   cost_us.FUNCTION=MICROSECONDS   every call of that device function (exact symbol) takes
 *                                at least this long, on any device, e.g.
 *                                cost_us.nvmlDeviceGetTotalEnergyConsumption=2313
 *   cost_us.field.ID=MICROSECONDS   nvmlDeviceGetFieldValues takes this much longer for each
 *                                requested field ID, e.g. cost_us.field.197=135
 *
 * A cost is spent spinning until the calling thread has used that much CPU time
 * (CLOCK_THREAD_CPUTIME_ID), as a driver's ioctl spends it: it stands for a real driver's
 * per-call cost (docs/gpu-validation.md has the H200's), so a benchmark can measure a sampling
 * schedule against it. On an idle machine the call's wall time is the same; on a loaded one,
 * the wall time grows with the waits for a core and the CPU time does not.
 *
 * Without the variable, nvmlInitWithFlags returns NVML_ERROR_DRIVER_NOT_LOADED.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define OK 0
#define E_UNINITIALIZED 1
#define E_INVALID_ARGUMENT 2
#define E_NOT_SUPPORTED 3
#define E_INSUFFICIENT_SIZE 7
#define E_DRIVER_NOT_LOADED 9
#define E_NO_PERMISSION 4
#define E_ARGUMENT_VERSION_MISMATCH 25
#define E_TIMEOUT 10
#define E_GPU_IS_LOST 15

#ifndef NVML_BRANCH
#define NVML_BRANCH 570
#endif
#if NVML_BRANCH >= 570
#define FI_LAST 268 /* every field id of CUDA 12.8's nvml.h, PCIe byte counters included */
#elif NVML_BRANCH >= 550
#define FI_LAST 196 /* 197/198 first defined in CUDA 12.5 */
#elif NVML_BRANCH >= 535
#define FI_LAST 196 /* NVML_FI_MAX 197 in CUDA 12.2 */
#else
#define FI_LAST 160 /* NVML_FI_MAX 161 in CUDA 11.4 */
#endif

#define MAX_GPUS 16
#define MAX_ERRORS 16
#define MAX_COSTS 32
#define MAX_FIELD_ID 300
#define MAX_PROCS 16
#define MAX_XIDS 64

struct gpu {
    char name[96], uuid[96], bus_id[32];
    unsigned int pci_device_id;
    unsigned long long mem_total, mem_used, energy_mj, clock_reasons;
    unsigned long long ecc[2][2]; /* [uncorrected][aggregate] */
    unsigned long long pcie_tx, pcie_rx, nvlink_tx_kib, nvlink_rx_kib;
    unsigned int util_gpu, util_mem, power_mw, power_limit_mw, temp, mem_temp;
    unsigned int sm_clock, mem_clock, sm_clock_max, mem_clock_max;
    unsigned int remap[4];
    int has_mem_temp, gpm, lost;
    double gpm_values[4]; /* sm_active, sm_occupancy, tensor_active, dram_active (%) */
    int n_procs;
    unsigned int proc_pid[MAX_PROCS];
    unsigned long long proc_bytes[MAX_PROCS];
    int n_xids, xids_delivered;
    unsigned long long xids[MAX_XIDS];
    int n_errors;
    char error_fn[MAX_ERRORS][64];
    int error_code[MAX_ERRORS];
};

static struct gpu gpus[MAX_GPUS];
static int n_gpus, init_error = E_DRIVER_NOT_LOADED, initialised;
static char driver_version[80] = "0.0";
static time_t config_mtime;
static long config_mtime_ns;
static int n_costs;
static char cost_fn[MAX_COSTS][64];
static long cost_us[MAX_COSTS];
static long field_cost_us[MAX_FIELD_ID + 1];

static void reset(void) {
    memset(gpus, 0, sizeof gpus);
    n_gpus = 0;
    n_costs = 0;
    memset(field_cost_us, 0, sizeof field_cost_us);
    init_error = OK;
    strcpy(driver_version, "550.54.15");
}

static void set_gpu(struct gpu *g, const char *key, const char *v) {
    unsigned long long n = strtoull(v, NULL, 0);
    if (!strcmp(key, "name")) snprintf(g->name, sizeof g->name, "%s", v);
    else if (!strcmp(key, "uuid")) snprintf(g->uuid, sizeof g->uuid, "%s", v);
    else if (!strcmp(key, "bus_id")) snprintf(g->bus_id, sizeof g->bus_id, "%s", v);
    else if (!strcmp(key, "pci_device_id")) g->pci_device_id = (unsigned int)n;
    else if (!strcmp(key, "mem_total")) g->mem_total = n;
    else if (!strcmp(key, "mem_used")) g->mem_used = n;
    else if (!strcmp(key, "util_gpu")) g->util_gpu = (unsigned int)n;
    else if (!strcmp(key, "util_mem")) g->util_mem = (unsigned int)n;
    else if (!strcmp(key, "power_mw")) g->power_mw = (unsigned int)n;
    else if (!strcmp(key, "power_limit_mw")) g->power_limit_mw = (unsigned int)n;
    else if (!strcmp(key, "energy_mj")) g->energy_mj = n;
    else if (!strcmp(key, "temp")) g->temp = (unsigned int)n;
    else if (!strcmp(key, "mem_temp")) { g->mem_temp = (unsigned int)n; g->has_mem_temp = 1; }
    else if (!strcmp(key, "sm_clock")) g->sm_clock = (unsigned int)n;
    else if (!strcmp(key, "mem_clock")) g->mem_clock = (unsigned int)n;
    else if (!strcmp(key, "sm_clock_max")) g->sm_clock_max = (unsigned int)n;
    else if (!strcmp(key, "mem_clock_max")) g->mem_clock_max = (unsigned int)n;
    else if (!strcmp(key, "clock_reasons")) g->clock_reasons = n;
    else if (!strcmp(key, "ecc_corr_vol")) g->ecc[0][0] = n;
    else if (!strcmp(key, "ecc_corr_agg")) g->ecc[0][1] = n;
    else if (!strcmp(key, "ecc_unc_vol")) g->ecc[1][0] = n;
    else if (!strcmp(key, "ecc_unc_agg")) g->ecc[1][1] = n;
    else if (!strcmp(key, "remap_corr")) g->remap[0] = (unsigned int)n;
    else if (!strcmp(key, "remap_unc")) g->remap[1] = (unsigned int)n;
    else if (!strcmp(key, "remap_pending")) g->remap[2] = (unsigned int)n;
    else if (!strcmp(key, "remap_failure")) g->remap[3] = (unsigned int)n;
    else if (!strcmp(key, "pcie_tx")) g->pcie_tx = n;
    else if (!strcmp(key, "pcie_rx")) g->pcie_rx = n;
    else if (!strcmp(key, "nvlink_tx_kib")) g->nvlink_tx_kib = n;
    else if (!strcmp(key, "nvlink_rx_kib")) g->nvlink_rx_kib = n;
    else if (!strcmp(key, "gpm")) g->gpm = (int)n;
    else if (!strcmp(key, "sm_active")) g->gpm_values[0] = strtod(v, NULL);
    else if (!strcmp(key, "sm_occupancy")) g->gpm_values[1] = strtod(v, NULL);
    else if (!strcmp(key, "tensor_active")) g->gpm_values[2] = strtod(v, NULL);
    else if (!strcmp(key, "dram_active")) g->gpm_values[3] = strtod(v, NULL);
    else if (!strcmp(key, "lost")) g->lost = (int)n;
    else if (!strcmp(key, "procs")) {
        const char *p = v;
        g->n_procs = 0;
        while (*p && g->n_procs < MAX_PROCS) {
            char *end;
            g->proc_pid[g->n_procs] = (unsigned int)strtoul(p, &end, 0);
            if (*end != ':') break;
            g->proc_bytes[g->n_procs++] = strtoull(end + 1, &end, 0);
            p = *end == ',' ? end + 1 : end;
        }
    } else if (!strcmp(key, "xid")) {
        const char *p = v;
        int n_before = g->xids_delivered;
        g->n_xids = 0;
        while (*p && g->n_xids < MAX_XIDS) {
            char *end;
            g->xids[g->n_xids++] = strtoull(p, &end, 0);
            p = *end == ',' ? end + 1 : end;
            if (end == p && *p) break;
        }
        g->xids_delivered = n_before;
    } else if (!strncmp(key, "error.", 6) && g->n_errors < MAX_ERRORS) {
        snprintf(g->error_fn[g->n_errors], 64, "%s", key + 6);
        g->error_code[g->n_errors++] = (int)n;
    }
}

/* Re-read the config when it changed; XIDs already delivered stay delivered. */
static void refresh(void) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    struct stat st;
    if (!path || stat(path, &st) != 0) {
        if (config_mtime) { reset(); init_error = E_DRIVER_NOT_LOADED; config_mtime = 0; }
        return;
    }
    if (st.st_mtim.tv_sec == config_mtime && st.st_mtim.tv_nsec == config_mtime_ns) return;
    config_mtime = st.st_mtim.tv_sec;
    config_mtime_ns = st.st_mtim.tv_nsec;
    int delivered[MAX_GPUS];
    for (int i = 0; i < MAX_GPUS; i++) delivered[i] = gpus[i].xids_delivered;
    reset();
    for (int i = 0; i < MAX_GPUS; i++) gpus[i].xids_delivered = delivered[i];
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        char *eq = strchr(line, '=');
        if (!eq || line[0] == '#') continue;
        *eq = 0;
        const char *key = line, *v = eq + 1;
        if (!strcmp(key, "init_error")) init_error = atoi(v);
        else if (!strncmp(key, "cost_us.field.", 14)) {
            long id = strtol(key + 14, NULL, 10);
            if (id >= 0 && id <= MAX_FIELD_ID) field_cost_us[id] = strtol(v, NULL, 10);
        } else if (!strncmp(key, "cost_us.", 8) && n_costs < MAX_COSTS) {
            snprintf(cost_fn[n_costs], sizeof cost_fn[n_costs], "%.63s", key + 8);
            cost_us[n_costs++] = strtol(v, NULL, 10);
        }
        else if (!strcmp(key, "driver_version")) snprintf(driver_version, sizeof driver_version, "%s", v);
        else if (!strcmp(key, "count")) n_gpus = atoi(v) > MAX_GPUS ? MAX_GPUS : atoi(v);
        else if (!strncmp(key, "gpu.", 4)) {
            char *end;
            long i = strtol(key + 4, &end, 10);
            if (*end == '.' && i >= 0 && i < MAX_GPUS) set_gpu(&gpus[i], end + 1, v);
        }
    }
    fclose(f);
}

/* Spend `us` microseconds of this thread's CPU time (a scripted per-call cost). */
static void spin(long us) {
    if (us <= 0) return;
    struct timespec t0, t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    do clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    while ((t.tv_sec - t0.tv_sec) * 1000000L + (t.tv_nsec - t0.tv_nsec) / 1000L < us);
}

static void pay(const char *fn) {
    for (int i = 0; i < n_costs; i++)
        if (!strcmp(cost_fn[i], fn)) spin(cost_us[i]);
}

/* Common prologue of every device call: its scripted cost, initialised, a valid handle, lost,
 * scripted error. */
static int check(struct gpu *g, const char *fn) {
    refresh();
    pay(fn);
    if (!initialised) return E_UNINITIALIZED;
    if (g < gpus || g >= gpus + n_gpus) return E_INVALID_ARGUMENT;
    if (g->lost) return E_GPU_IS_LOST;
    for (int i = 0; i < g->n_errors; i++)
        if (!strcmp(g->error_fn[i], fn)) return g->error_code[i];
    return OK;
}

#define CHECK(g) do { int rc_ = check((g), __func__); if (rc_) return rc_; } while (0)

int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    refresh();
    if (init_error) return init_error;
    initialised = 1;
    return OK;
}

int nvmlShutdown(void) { initialised = 0; return OK; }

const char *nvmlErrorString(int code) {
    switch (code) {
    case OK: return "Success";
    case E_UNINITIALIZED: return "Uninitialized";
    case E_NOT_SUPPORTED: return "Not Supported";
    case E_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case E_TIMEOUT: return "Timeout";
    case E_GPU_IS_LOST: return "GPU is lost";
    case E_INVALID_ARGUMENT: return "Invalid Argument";
    case E_NO_PERMISSION: return "Insufficient Permissions";
    case 13: return "Function Not Found";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    default: return "Unknown Error";
    }
}

int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    refresh();
    if (!initialised) return E_UNINITIALIZED;
    if (strlen(driver_version) + 1 > length) return E_INSUFFICIENT_SIZE;
    strcpy(version, driver_version);
    return OK;
}

int nvmlDeviceGetCount_v2(unsigned int *count) {
    refresh();
    if (!initialised) return E_UNINITIALIZED;
    *count = (unsigned int)n_gpus;
    return OK;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, struct gpu **device) {
    refresh();
    if (!initialised) return E_UNINITIALIZED;
    if (index >= (unsigned int)n_gpus) return E_INVALID_ARGUMENT;
    if (gpus[index].lost) return E_GPU_IS_LOST;
    *device = &gpus[index];
    return OK;
}

static int copy_text(char *out, unsigned int length, const char *text) {
    if (strlen(text) + 1 > length) return E_INSUFFICIENT_SIZE;
    strcpy(out, text);
    return OK;
}

int nvmlDeviceGetName(struct gpu *g, char *name, unsigned int length) {
    CHECK(g);
    return copy_text(name, length, g->name);
}

int nvmlDeviceGetUUID(struct gpu *g, char *uuid, unsigned int length) {
    CHECK(g);
    return copy_text(uuid, length, g->uuid);
}

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

#ifndef NO_PCI_INFO
/* Domain, bus and device parsed back out of the scripted "DDDDDDDD:BB:DD.F" bus id. */
static void fill_pci_numbers(struct gpu *g, nvmlPciInfo_t *pci) {
    unsigned int domain = 0, bus = 0, device = 0;
    if (sscanf(g->bus_id, "%x:%x:%x", &domain, &bus, &device) == 3) {
        pci->domain = domain;
        pci->bus = bus;
        pci->device = device;
    }
    pci->pciDeviceId = g->pci_device_id;
}

int nvmlDeviceGetPciInfo_v3(struct gpu *g, nvmlPciInfo_t *pci) {
    CHECK(g);
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", g->bus_id);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%s", g->bus_id + (strlen(g->bus_id) > 12 ? 4 : 0));
    fill_pci_numbers(g, pci);
    return OK;
}

/* _v2 and v1 fill the pre-_v3 layout: busId[16] first, then the numbers, then reserved
 * words where _v3 has its 32-byte busId (left untouched here, as by an old driver). */
typedef struct {
    char busId[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId, reserved[4];
} nvmlPciInfoLegacy_t;

static int legacy_pci(struct gpu *g, nvmlPciInfoLegacy_t *pci) {
    nvmlPciInfo_t full;
    memset(&full, 0, sizeof full);
    fill_pci_numbers(g, &full);
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", g->bus_id + (strlen(g->bus_id) > 12 ? 4 : 0));
    pci->domain = full.domain;
    pci->bus = full.bus;
    pci->device = full.device;
    pci->pciDeviceId = full.pciDeviceId;
    return OK;
}

int nvmlDeviceGetPciInfo_v2(struct gpu *g, nvmlPciInfoLegacy_t *pci) { CHECK(g); return legacy_pci(g, pci); }
int nvmlDeviceGetPciInfo(struct gpu *g, nvmlPciInfoLegacy_t *pci) { CHECK(g); return legacy_pci(g, pci); }
#endif

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;

int nvmlDeviceGetMemoryInfo(struct gpu *g, nvmlMemory_t *m) {
    CHECK(g);
    m->total = g->mem_total;
    m->used = g->mem_used;
    m->free = g->mem_total - g->mem_used;
    return OK;
}

#if NVML_BRANCH >= 535
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;

/* The driver's reservation (a fixed 512 MiB here) is split out of used. */
int nvmlDeviceGetMemoryInfo_v2(struct gpu *g, nvmlMemory_v2_t *m) {
    CHECK(g);
    if (m->version >> 24 != 2) return E_ARGUMENT_VERSION_MISMATCH;
    m->total = g->mem_total;
    m->free = g->mem_total - g->mem_used;
    m->reserved = g->mem_used < (512ULL << 20) ? g->mem_used : 512ULL << 20;
    m->used = g->mem_used - m->reserved;
    return OK;
}
#endif

typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;

int nvmlDeviceGetUtilizationRates(struct gpu *g, nvmlUtilization_t *u) {
    CHECK(g);
    u->gpu = g->util_gpu;
    u->memory = g->util_mem;
    return OK;
}

int nvmlDeviceGetPowerUsage(struct gpu *g, unsigned int *mw) { CHECK(g); *mw = g->power_mw; return OK; }
int nvmlDeviceGetEnforcedPowerLimit(struct gpu *g, unsigned int *mw) { CHECK(g); *mw = g->power_limit_mw; return OK; }
int nvmlDeviceGetTotalEnergyConsumption(struct gpu *g, unsigned long long *mj) { CHECK(g); *mj = g->energy_mj; return OK; }

int nvmlDeviceGetTemperature(struct gpu *g, int sensor, unsigned int *c) {
    CHECK(g);
    if (sensor != 0) return E_INVALID_ARGUMENT;
    *c = g->temp;
    return OK;
}

#if NVML_BRANCH >= 570
typedef struct { unsigned int version; int sensorType; int temperature; } nvmlTemperature_t;

int nvmlDeviceGetTemperatureV(struct gpu *g, nvmlTemperature_t *t) {
    CHECK(g);
    if (t->version >> 24 != 1) return E_ARGUMENT_VERSION_MISMATCH;
    if (t->sensorType != 0) return E_INVALID_ARGUMENT;
    t->temperature = (int)g->temp;
    return OK;
}
#endif

int nvmlDeviceGetClockInfo(struct gpu *g, int type, unsigned int *mhz) {
    CHECK(g);
    if (type == 1) *mhz = g->sm_clock;
    else if (type == 2) *mhz = g->mem_clock;
    else return E_NOT_SUPPORTED;
    return OK;
}

int nvmlDeviceGetMaxClockInfo(struct gpu *g, int type, unsigned int *mhz) {
    CHECK(g);
    if (type == 1) *mhz = g->sm_clock_max;
    else if (type == 2) *mhz = g->mem_clock_max;
    else return E_NOT_SUPPORTED;
    return OK;
}

int nvmlDeviceGetCurrentClocksThrottleReasons(struct gpu *g, unsigned long long *reasons) {
    CHECK(g);
    *reasons = g->clock_reasons;
    return OK;
}

#if NVML_BRANCH >= 535
int nvmlDeviceGetCurrentClocksEventReasons(struct gpu *g, unsigned long long *reasons) {
    CHECK(g);
    *reasons = g->clock_reasons;
    return OK;
}
#endif

int nvmlDeviceGetTotalEccErrors(struct gpu *g, int error_type, int counter_type, unsigned long long *n) {
    CHECK(g);
    if (error_type < 0 || error_type > 1 || counter_type < 0 || counter_type > 1) return E_INVALID_ARGUMENT;
    *n = g->ecc[error_type][counter_type];
    return OK;
}

int nvmlDeviceGetRemappedRows(struct gpu *g, unsigned int *corr, unsigned int *unc, unsigned int *pending, unsigned int *failure) {
    CHECK(g);
    *corr = g->remap[0];
    *unc = g->remap[1];
    *pending = g->remap[2];
    *failure = g->remap[3];
    return OK;
}

#ifndef NO_FIELD_VALUES
typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType, nvmlReturn;
    union { double d; unsigned int ui; unsigned long long ull; } value;
} nvmlFieldValue_t;

int nvmlDeviceGetFieldValues(struct gpu *g, int count, nvmlFieldValue_t *values) {
    CHECK(g);
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *f = &values[i];
        if (f->fieldId <= MAX_FIELD_ID) spin(field_cost_us[f->fieldId]);
        f->nvmlReturn = OK;
        f->valueType = 3; /* unsigned long long */
        switch (f->fieldId) {
        case 82: /* NVML_FI_DEV_MEMORY_TEMP */
            if (!g->has_mem_temp) { f->nvmlReturn = E_NOT_SUPPORTED; break; }
            f->valueType = 1;
            f->value.ui = g->mem_temp;
            break;
        case 138: f->value.ull = g->nvlink_tx_kib; break;
        case 139: f->value.ull = g->nvlink_rx_kib; break;
        case 197: f->value.ull = g->pcie_tx; break;
        case 198: f->value.ull = g->pcie_rx; break;
        default: f->nvmlReturn = E_NOT_SUPPORTED;
        }
        if (f->fieldId > FI_LAST) f->nvmlReturn = E_INVALID_ARGUMENT; /* newer than this branch */
    }
    return OK;
}
#endif

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t; /* nvmlProcessInfo_v2_t, used by _v2 and _v3 */

typedef struct { unsigned int pid; unsigned long long usedGpuMemory; } nvmlProcessInfo_v1_t;

static int procs_v2(struct gpu *g, unsigned int *count, nvmlProcessInfo_t *infos) {
    if (g->n_procs == 0) { *count = 0; return OK; }
    if (!infos || *count < (unsigned int)g->n_procs) { *count = (unsigned int)g->n_procs; return E_INSUFFICIENT_SIZE; }
    for (int i = 0; i < g->n_procs; i++) {
        infos[i].pid = g->proc_pid[i];
        infos[i].usedGpuMemory = g->proc_bytes[i];
        infos[i].gpuInstanceId = infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    *count = (unsigned int)g->n_procs;
    return OK;
}

int nvmlDeviceGetComputeRunningProcesses(struct gpu *g, unsigned int *count, nvmlProcessInfo_v1_t *infos) {
    CHECK(g);
    if (g->n_procs == 0) { *count = 0; return OK; }
    if (!infos || *count < (unsigned int)g->n_procs) { *count = (unsigned int)g->n_procs; return E_INSUFFICIENT_SIZE; }
    for (int i = 0; i < g->n_procs; i++) {
        infos[i].pid = g->proc_pid[i];
        infos[i].usedGpuMemory = g->proc_bytes[i];
    }
    *count = (unsigned int)g->n_procs;
    return OK;
}

int nvmlDeviceGetComputeRunningProcesses_v2(struct gpu *g, unsigned int *count, nvmlProcessInfo_t *infos) {
    CHECK(g);
    return procs_v2(g, count, infos);
}

#if NVML_BRANCH >= 535
int nvmlDeviceGetComputeRunningProcesses_v3(struct gpu *g, unsigned int *count, nvmlProcessInfo_t *infos) {
    CHECK(g);
    return procs_v2(g, count, infos);
}
#endif

#if NVML_BRANCH >= 535 && !defined(NO_GPM)
typedef struct { unsigned int version, isSupportedDevice; } nvmlGpmSupport_t;
struct gpm_sample { struct gpu *g; int filled; };
typedef struct {
    unsigned int metricId;
    int nvmlReturn;
    double value;
    const char *shortName, *longName, *unit;
} nvmlGpmMetric_t;
typedef struct {
    unsigned int version, numMetrics;
    struct gpm_sample *sample1, *sample2;
    nvmlGpmMetric_t metrics[477];
} nvmlGpmMetricsGet_t;

int nvmlGpmQueryDeviceSupport(struct gpu *g, nvmlGpmSupport_t *s) {
    CHECK(g);
    s->isSupportedDevice = (unsigned int)g->gpm;
    return OK;
}

int nvmlGpmSampleAlloc(struct gpm_sample **out) {
    *out = calloc(1, sizeof **out);
    return *out ? OK : 20;
}

int nvmlGpmSampleFree(struct gpm_sample *s) { free(s); return OK; }

int nvmlGpmSampleGet(struct gpu *g, struct gpm_sample *s) {
    CHECK(g);
    if (!g->gpm) return E_NOT_SUPPORTED;
    s->g = g;
    s->filled = 1;
    return OK;
}

int nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *m) {
    refresh();
    pay(__func__);
    if (!m->sample1 || !m->sample2 || !m->sample1->filled || !m->sample2->filled) return E_INVALID_ARGUMENT;
    struct gpu *g = m->sample2->g;
    if (g->lost) return E_GPU_IS_LOST;
    for (unsigned int i = 0; i < m->numMetrics && i < 477; i++) {
        nvmlGpmMetric_t *x = &m->metrics[i];
        x->nvmlReturn = OK;
        switch (x->metricId) {
        case 2: x->value = g->gpm_values[0]; break;
        case 3: x->value = g->gpm_values[1]; break;
        case 5: x->value = g->gpm_values[2]; break;
        case 10: x->value = g->gpm_values[3]; break;
        default: x->nvmlReturn = E_NOT_SUPPORTED;
        }
    }
    return OK;
}
#endif

typedef struct {
    struct gpu *device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;
struct event_set { int registered[MAX_GPUS]; };

int nvmlEventSetCreate(struct event_set **set) {
    refresh();
    if (!initialised) return E_UNINITIALIZED;
    *set = calloc(1, sizeof **set);
    return *set ? OK : 20;
}

int nvmlEventSetFree(struct event_set *set) { free(set); return OK; }

int nvmlDeviceRegisterEvents(struct gpu *g, unsigned long long types, struct event_set *set) {
    CHECK(g);
    if (types & 0x8ULL) set->registered[g - gpus] = 1; /* nvmlEventTypeXidCriticalError */
    return OK;
}

static int event_wait(struct event_set *set, nvmlEventData_t *data) {
    refresh();
    if (!initialised) return E_UNINITIALIZED;
    for (int i = 0; i < n_gpus; i++) {
        struct gpu *g = &gpus[i];
        if (set->registered[i] && !g->lost && g->xids_delivered < g->n_xids) {
            data->device = g;
            data->eventType = 0x8ULL;
            data->eventData = g->xids[g->xids_delivered++];
            data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
            return OK;
        }
    }
    return E_TIMEOUT;
}

/* The sampler polls with 0 ms, so the fake never sleeps. v1's nvmlEventData_t lacks the two
 * instance ids at its end; no caller here passes one. */
int nvmlEventSetWait_v2(struct event_set *set, nvmlEventData_t *data, unsigned int timeout_ms) {
    (void)timeout_ms;
    return event_wait(set, data);
}

int nvmlEventSetWait(struct event_set *set, nvmlEventData_t *data, unsigned int timeout_ms) {
    (void)timeout_ms;
    return event_wait(set, data);
}
