/* Makes MKL take its Intel code path on a CPU of another vendor, so that the tests can run MKL's Intel kernels on
 * an AMD machine (scripts/test.sh preloads it: LD_PRELOAD). MKL asks these two functions whether the CPU is an
 * Intel one; torch's CPU build links MKL statically but calls them through its symbol table, so the preloaded
 * definitions answer instead. Only for the test run: a product is then computed by the kernels an Intel CPU
 * with the same instruction sets would use. */
int mkl_serv_intel_cpu_true(void) { return 1; }
int mkl_serv_intel_cpu(void) { return 1; }
