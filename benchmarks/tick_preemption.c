/*
 * What a busy host's scheduler costs a short copy, without any engine.
 *
 * Two processes keep both cores busy: plain spinners (`spin`) or, as vLLM's
 * processes do while they poll their shared-memory queues, spinners that
 * call sched_yield() each turn (`yield`). This process then repeats what a
 * decode worker does with a load: it sleeps (waiting for a step), runs for
 * PROLOGUE_MS (the step's own work before the load), and times a copy of
 * COPIES x 6 MiB (about the largest load of bench_vllm_pd.py). It prints
 * how many copies took over 4 and 5 ms.
 *
 *   mkdir -p build && cc -O2 -o build/tick_preemption benchmarks/tick_preemption.c
 *   build/tick_preemption spin 150 3 5
 *   build/tick_preemption yield 150 3 5
 *
 * A thread that is preempted while it copies waits for the spinner to end
 * its turn, which a plain spinner does only at a scheduler tick (4 ms at
 * CONFIG_HZ=250); a yielding one gives the core back at once.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
  if (argc != 5 || (strcmp(argv[1], "spin") != 0 && strcmp(argv[1], "yield") != 0)) {
    fprintf(stderr, "usage: %s spin|yield ROUNDS PROLOGUE_MS COPIES\n", argv[0]);
    return 2;
  }
  const int yielding = strcmp(argv[1], "yield") == 0;
  const int rounds = atoi(argv[2]);
  const double prologue_ms = atof(argv[3]);
  const int copies = atoi(argv[4]);
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  pid_t busy[64];
  const long spinners = cores < 64 ? cores : 64;
  for (long i = 0; i < spinners; ++i) {
    busy[i] = fork();
    if (busy[i] == 0) {
      for (;;) {
        if (yielding) sched_yield();
      }
    }
  }
  const size_t size = 6u << 20;
  char *from = malloc(size), *to = malloc(size);
  if (from == NULL || to == NULL) return 1;
  memset(from, 1, size);
  memset(to, 2, size);
  int over4 = 0, over5 = 0;
  double worst = 0, sum = 0;
  for (int r = 0; r < rounds; ++r) {
    usleep(20000);
    const double start = now_ms();
    while (now_ms() - start < prologue_ms) {
    }
    const double t0 = now_ms();
    for (int c = 0; c < copies; ++c) memcpy(to, from, size);
    const double took = now_ms() - t0;
    over4 += took > 4;
    over5 += took > 5;
    worst = took > worst ? took : worst;
    sum += took;
  }
  printf("%s spinners=%ld rounds=%d prologue=%.1f ms copy: mean %.2f ms, largest %.2f ms, over 4 ms %d, over 5 ms %d\n",
         argv[1], spinners, rounds, prologue_ms, sum / rounds, worst, over4, over5);
  for (long i = 0; i < spinners; ++i) {
    kill(busy[i], SIGKILL);
    waitpid(busy[i], NULL, 0);
  }
  return 0;
}
