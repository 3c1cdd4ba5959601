// Issue #22 prototype (2026-12-04), not part of kvserve: the Q4_1 decode kernel's bf16 path with the
// float32 scales as held (three arrays) against the file's fp16 scales interleaved after each block of 4
// rows; prints both times and their ratio. See README "The file's fp16 scales, tried and left out".
// Build and run: gcc -O3 -march=native -fopenmp fp16_scales.c -o /tmp/fp16_scales && OMP_NUM_THREADS=2 OMP_PROC_BIND=true /tmp/fp16_scales 200000
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define T __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#define INL static inline __attribute__((always_inline))
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
INL T __m512bh deqv(const uint8_t* p, int r, __m512 dv, __m512 mv);
INL T __m512bh deq(const uint8_t* p, int r, float d, float m){ return deqv(p,r,_mm512_set1_ps(d),_mm512_set1_ps(m)); }
INL T __m512bh deqv(const uint8_t* p, int r, __m512 dv, __m512 mv){
  const __m512 iota=_mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15);
  const __m512 t=_mm512_fmadd_ps(dv,iota,mv);
  const __m512i table=(__m512i)_mm512_cvtne2ps_pbh(t,t);
  const __m512i shifts=_mm512_setr_epi32(0,0,0,0,0,0,0,0,0x00040004,0x00040004,0x00040004,0x00040004,0x00040004,0x00040004,0x00040004,0x00040004);
  const __m512i u=_mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(p+16*r))));
  return (__m512bh)_mm512_permutexvar_epi16(_mm512_srlv_epi16(u,shifts),table);
}
// A: qs [G][KB][64], d/m [G][KB][4] f32
T void gemvA(const uint16_t* x,const uint8_t* qs,const float* d,const float* m,int64_t K,int64_t G,float* y){
  int64_t KB=K/32;
  #pragma omp parallel for schedule(static)
  for(int64_t g=0;g<G;g++){
    __m512 acc[4]={_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps()};
    const uint8_t* gq=qs+g*KB*64; const float* gd=d+g*KB*4; const float* gm=m+g*KB*4;
    for(int64_t b=0;b<KB;b++){
      const uint8_t* p=gq+b*64; _mm_prefetch((const char*)p+1024,_MM_HINT_T0);
      __m512bh xv=(__m512bh)_mm512_loadu_si512(x+32*b);
      for(int r=0;r<4;r++) acc[r]=_mm512_dpbf16_ps(acc[r],deq(p,r,gd[4*b+r],gm[4*b+r]),xv);
    }
    for(int r=0;r<4;r++) y[4*g+r]=_mm512_reduce_add_ps(acc[r]);
  }
}
// B: [G][KB][64 qs + 8 fp16 (d0..3, m0..3)] = 80 B
T void gemvB(const uint16_t* x,const uint8_t* qs,int64_t K,int64_t G,float* y){
  int64_t KB=K/32;
  #pragma omp parallel for schedule(static)
  for(int64_t g=0;g<G;g++){
    __m512 acc[4]={_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps()};
    const uint8_t* gq=qs+g*KB*80;
    for(int64_t b=0;b<KB;b++){
      const uint8_t* p=gq+b*80; _mm_prefetch((const char*)p+1024,_MM_HINT_T0); _mm_prefetch((const char*)p+1024+64,_MM_HINT_T0);
      const __m512 dm=_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p+64))));
      __m512bh xv=(__m512bh)_mm512_loadu_si512(x+32*b);
      for(int r=0;r<4;r++) acc[r]=_mm512_dpbf16_ps(acc[r],deqv(p,r,_mm512_permutexvar_ps(_mm512_set1_epi32(r),dm),_mm512_permutexvar_ps(_mm512_set1_epi32(4+r),dm)),xv);
    }
    for(int r=0;r<4;r++) y[4*g+r]=_mm512_reduce_add_ps(acc[r]);
  }
}
int main(int argc,char**argv){
  int64_t K=576, N=atoll(argc>1?argv[1]:"200000"); int64_t G=N/4, KB=K/32; int reps=20;
  uint8_t* qs=aligned_alloc(64,G*KB*64); float* d=aligned_alloc(64,G*KB*16); float* m=aligned_alloc(64,G*KB*16);
  uint8_t* qb=aligned_alloc(64,G*KB*80); uint16_t* x=aligned_alloc(64,K*2); float* ya=malloc(N*4); float* yb=malloc(N*4);
  srand(1); for(int64_t i=0;i<G*KB*64;i++) qs[i]=rand();
  for(int64_t i=0;i<G*KB*4;i++){ d[i]=(float)(rand()%100)/4096.f; m[i]=-(float)(rand()%100)/512.f; }
  for(int64_t g=0;g<G;g++) for(int64_t b=0;b<KB;b++){ uint8_t* p=qb+(g*KB+b)*80; memcpy(p,qs+(g*KB+b)*64,64);
    __m128i h=_mm256_cvtps_ph(_mm256_setr_ps(d[(g*KB+b)*4],d[(g*KB+b)*4+1],d[(g*KB+b)*4+2],d[(g*KB+b)*4+3],m[(g*KB+b)*4],m[(g*KB+b)*4+1],m[(g*KB+b)*4+2],m[(g*KB+b)*4+3]),0);
    _mm_storeu_si128((__m128i*)(p+64),h);}
  for(int i=0;i<K;i++) x[i]=0x3f80+(rand()%64);
  double ta=1e9,tb=1e9;
  for(int round=0;round<reps;round++){
    double t0=now(); gemvA(x,qs,d,m,K,G,ya); double t1=now(); gemvB(x,qb,K,G,yb); double t2=now();
    if(t1-t0<ta)ta=t1-t0; if(t2-t1<tb)tb=t2-t1;
  }
  double err=0; for(int64_t i=0;i<N;i++){ double e=ya[i]-yb[i]; if(e<0)e=-e; if(e>err)err=e; }
  double bA=G*KB*(64+32.0), bB=G*KB*80.0;
  printf("N=%ld threads=%d  A %.3f ms (%.1f GB/s)  B %.3f ms (%.1f GB/s)  B/A time %.3f  maxdiff %g\n",(long)N,omp_get_max_threads(),ta*1e3,bA/ta/1e9,tb*1e3,bB/tb/1e9,tb/ta,err);
}
