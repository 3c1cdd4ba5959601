// Issue #22 prototype (2026-12-04), not part of kvserve: a simulated SmolLM2 Q4_1 decode step (30 layers x
// 4 GEMVs, M = 1, 2 threads in one team, a barrier after each GEMV) with the float32 scales in three arrays
// (A, as held) against interleaved with the nibbles (C, one stream); prints 8 rounds.
// Build and run: gcc -O3 -march=native -fopenmp interleaved_step.c -o /tmp/interleaved_step && OMP_PROC_BIND=true /tmp/interleaved_step
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
INL T __m512bh deq(const uint8_t* p, int r, float d, float m){
  const __m512 iota=_mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15);
  const __m512 t=_mm512_fmadd_ps(_mm512_set1_ps(d),iota,_mm512_set1_ps(m));
  const __m512i table=(__m512i)_mm512_cvtne2ps_pbh(t,t);
  const __m512i shifts=_mm512_setr_epi32(0,0,0,0,0,0,0,0,0x00040004,0x00040004,0x00040004,0x00040004,0x00040004,0x00040004,0x00040004,0x00040004);
  const __m512i u=_mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(p+16*r))));
  return (__m512bh)_mm512_permutexvar_epi16(_mm512_srlv_epi16(u,shifts),table);
}
typedef struct { int64_t N,K; uint8_t* qs; float *d,*m; uint8_t* qc; } W;
T static void runA(const uint16_t* x,const W* w,float* y,int64_t g0,int64_t g1){
  int64_t KB=w->K/32;
  for(int64_t g=g0;g<g1;g++){
    __m512 acc[4]={_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps()};
    const uint8_t* gq=w->qs+g*KB*64; const float* gd=w->d+g*KB*4; const float* gm=w->m+g*KB*4;
    for(int64_t b=0;b<KB;b++){ const uint8_t* p=gq+b*64; _mm_prefetch((const char*)p+1024,_MM_HINT_T0);
      __m512bh xv=(__m512bh)_mm512_loadu_si512(x+32*b);
      for(int r=0;r<4;r++) acc[r]=_mm512_dpbf16_ps(acc[r],deq(p,r,gd[4*b+r],gm[4*b+r]),xv); }
    for(int r=0;r<4;r++) y[4*g+r]=_mm512_reduce_add_ps(acc[r]);
  }
}
T static void runC(const uint16_t* x,const W* w,float* y,int64_t g0,int64_t g1){
  int64_t KB=w->K/32;
  for(int64_t g=g0;g<g1;g++){
    __m512 acc[4]={_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps()};
    const uint8_t* gq=w->qc+g*KB*96;
    for(int64_t b=0;b<KB;b++){ const uint8_t* p=gq+b*96; _mm_prefetch((const char*)p+1024,_MM_HINT_T0); _mm_prefetch((const char*)p+1024+64,_MM_HINT_T0);
      const float* dm=(const float*)(p+64);
      __m512bh xv=(__m512bh)_mm512_loadu_si512(x+32*b);
      for(int r=0;r<4;r++) acc[r]=_mm512_dpbf16_ps(acc[r],deq(p,r,dm[r],dm[4+r]),xv); }
    for(int r=0;r<4;r++) y[4*g+r]=_mm512_reduce_add_ps(acc[r]);
  }
}
static void mk(W* w,int64_t N,int64_t K){ w->N=N; w->K=K; int64_t G=N/4,KB=K/32;
  w->qs=aligned_alloc(64,G*KB*64); w->d=aligned_alloc(64,G*KB*16); w->m=aligned_alloc(64,G*KB*16); w->qc=aligned_alloc(64,G*KB*96);
  for(int64_t i=0;i<G*KB*64;i++) w->qs[i]=rand();
  for(int64_t i=0;i<G*KB*4;i++){ w->d[i]=(rand()%100)/4096.f; w->m[i]=-(rand()%100)/512.f; }
  for(int64_t i=0;i<G*KB;i++){ memcpy(w->qc+i*96,w->qs+i*64,64); memcpy(w->qc+i*96+64,w->d+i*4,16); memcpy(w->qc+i*96+80,w->m+i*4,16);} }
int main(){
  enum{L=30}; W w[L][4]; int64_t shp[4][2]={{960,576},{576,576},{3072,576},{576,1536}};
  srand(1); for(int l=0;l<L;l++) for(int j=0;j<4;j++) mk(&w[l][j],shp[j][0],shp[j][1]);
  uint16_t* x=aligned_alloc(64,1536*2); for(int i=0;i<1536;i++) x[i]=0x3f80+(rand()%64);
  float* y=malloc(3072*4); char* flush=malloc(256<<20);
  for(int round=0;round<8;round++){ double t[2];
    for(int v=0;v<2;v++){ memset(flush,round,256<<20);
      double t0=now();
      #pragma omp parallel num_threads(2)
      { for(int l=0;l<L;l++) for(int j=0;j<4;j++){ int64_t G=w[l][j].N/4,nt=2,tid=omp_get_thread_num(),per=(G+1)/2,g0=tid*per,g1=g0+per<G?g0+per:G;
          if(v==0) runA(x,&w[l][j],y,g0,g1); else runC(x,&w[l][j],y,g0,g1);
          #pragma omp barrier
        } }
      t[v]=now()-t0; }
    double bytesA=0; for(int l=0;l<L;l++) for(int j=0;j<4;j++) bytesA+=w[l][j].N*w[l][j].K*0.75;
    printf("A %.2f ms (%.1f GB/s)  C %.2f ms (%.1f GB/s)  C/A %.3f\n",t[0]*1e3,bytesA/t[0]/1e9,t[1]*1e3,bytesA/t[1]/1e9,t[1]/t[0]); }
}
