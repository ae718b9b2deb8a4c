/* The thread count of every parallel region in the CPU kernels (common.h, TF_THREADS).
 *
 * omp_set_num_threads sets the count for the calling thread only, and a thread that never called it
 * starts from OMP_NUM_THREADS or every core of the process's affinity mask: the engine can step on
 * another thread than the one that planned the threads (AsyncEngine's engine thread). One setting
 * here holds for every calling thread, as torch.set_num_threads does for torch's own kernels.
 * engine/runner/cpu_threads.py sets both. */
#include <omp.h>

#include "common.h"

int tf_threads_setting = 0; /* 0: not set (OpenMP's default for the calling thread) */

void tf_set_num_threads(int n) { tf_threads_setting = n > 0 ? n : 0; }

int tf_get_num_threads(void) { return tf_nthreads(); }

/* how many threads a parallel region of the kernels actually runs (what the tests check) */
int tf_parallel_width(void) {
    int width = 0;
#pragma omp parallel num_threads(tf_nthreads())
    {
#pragma omp single
        width = omp_get_num_threads();
    }
    return width;
}
