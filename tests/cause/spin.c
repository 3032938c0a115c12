/* A C routine that never returns: called through ctypes.PyDLL it spins holding the GIL. */
volatile unsigned long spins;
void spin_forever(void) { for (;;) spins++; }
