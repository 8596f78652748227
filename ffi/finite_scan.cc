// NaN/inf scan of checkpoint tensors in one pass, fused with the read (issue 13, item 14).
//
// Why native: the loader checks every float tensor it reads for NaN and infinity (an FP8 byte
// 0x7F/0xFF, an inf in a bf16 norm weight) and the check must cost under 5% of a warm load. numpy
// needs two integer max-reductions per chunk (a signed and an unsigned view) plus a Python call per
// chunk; here one loop reads each chunk and tests it while it is still in the L2 cache.
//
// The test: a value is non-finite when its magnitude bits (all but the sign) are >= E, E being the
// all-ones exponent (float8_e4m3fn: 0x7F, its only NaN codes being S.1111.111). For a lane of w
// bits with sign bit S,
//     (x & (S - 1)) + (S - E)   has bit S set   iff   (x & (S - 1)) >= E,
// and the sum never carries out of its lane (it is at most 2S - 1 - E < 2S). Replicated across a
// 64-bit word, one and plus one add tests 8 FP8, 4 bf16/f16, 2 f32 or 1 f64 values; the sums are
// ORed together and their sign bits looked at once per block, which the compiler vectorises.
#include <sched.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <system_error>
#include <thread>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "lanes are laid out little-endian");

namespace {

using Word = uint64_t;
typedef Word Vec __attribute__((vector_size(32)));  // 4 words; two SSE2 or one AVX2 register

constexpr int64_t kBlockBytes = 4096;          // the accumulator is tested this often: a bad value is found early
constexpr int64_t kReadBytes = 1 << 20;         // one pread(); the scanner follows a piece behind, in cache
constexpr int64_t kHelperMinBytes = 4 << 20;    // below this a helper thread costs more than it hides

struct Lanes {
  int width;        // bytes per element: 1, 2, 4 or 8
  Word exponent;    // E of one lane
  Word sign;        // S of one lane
  Word mask, add, top;  // (S - 1), (S - E) and S replicated across a word
};

Word Replicate(Word lane, int width) {
  Word out = 0;
  for (int i = 0; i < 8 / width; ++i) out |= lane << (8 * width * i);
  return out;
}

bool MakeLanes(int width, Word exponent, Lanes* l) {
  if (width != 1 && width != 2 && width != 4 && width != 8) return false;
  l->width = width;
  l->sign = Word{1} << (8 * width - 1);
  l->exponent = exponent;
  if (exponent == 0 || exponent >= l->sign) return false;
  l->mask = Replicate(l->sign - 1, width);
  l->add = Replicate(l->sign - exponent, width);
  l->top = Replicate(l->sign, width);
  return true;
}

// OR of the lane sums of `bytes` bytes (a multiple of sizeof(Vec)); its `top` bits flag a hit.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx2", "default")))
#endif
Word Sums(const unsigned char* p, int64_t bytes, Word mask, Word add) {
  const Vec vmask = {mask, mask, mask, mask}, vadd = {add, add, add, add};
  Vec acc = {0, 0, 0, 0};
  for (int64_t i = 0; i < bytes; i += sizeof(Vec)) {
    Vec v;
    std::memcpy(&v, p + i, sizeof(Vec));  // an unaligned load; data need not be aligned
    acc |= (v & vmask) + vadd;
  }
  return acc[0] | acc[1] | acc[2] | acc[3];
}

// The first element of [p, p + count) that is non-finite, or -1; element by element.
int64_t FirstSlow(const unsigned char* p, int64_t count, const Lanes& l) {
  for (int64_t i = 0; i < count; ++i) {
    Word x = 0;
    std::memcpy(&x, p + i * l.width, l.width);
    if ((x & (l.sign - 1)) >= l.exponent) return i;
  }
  return -1;
}

// The first non-finite element of `count` elements at p, or -1.
int64_t Find(const unsigned char* p, int64_t count, const Lanes& l) {
  const int64_t bytes = count * l.width;
  int64_t done = 0;
  while (bytes - done >= static_cast<int64_t>(sizeof(Vec))) {
    int64_t n = bytes - done < kBlockBytes ? bytes - done : kBlockBytes;
    n -= n % sizeof(Vec);
    if (Sums(p + done, n, l.mask, l.add) & l.top) {
      return done / l.width + FirstSlow(p + done, n / l.width, l);  // a hit lies in this block
    }
    done += n;
  }
  int64_t tail = FirstSlow(p + done, (bytes - done) / l.width, l);
  return tail < 0 ? -1 : done / l.width + tail;
}

// Scans behind a reader: the caller's thread reads piece after piece while this helper thread scans
// every piece that has landed, on another core, so that a warm load (bound by the kernel's copy out
// of the page cache) pays nothing for the scan. The pieces are still in the shared cache when it
// reads them. Publish/Finish hand over byte counts under a mutex, which also orders the data.
class BehindScanner {
 public:
  BehindScanner(const unsigned char* base, const Lanes& lanes) : base_(base), lanes_(lanes) {
    thread_ = std::thread([this] { Run(); });  // throws std::system_error if no thread can be made
  }

  void Publish(int64_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_ = bytes;
    }
    cv_.notify_one();
  }

  // Waits for the scan of everything published; the first non-finite element's index, or -1.
  int64_t Finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_one();
    thread_.join();
    return first_bad_;
  }

 private:
  void Run() {
    int64_t scanned = 0;  // elements
    for (;;) {
      int64_t whole;
      bool done;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return done_ || ready_ / lanes_.width > scanned; });
        whole = ready_ / lanes_.width;
        done = done_;
      }
      if (whole > scanned && first_bad_ < 0) {
        int64_t hit = Find(base_ + scanned * lanes_.width, whole - scanned, lanes_);
        if (hit >= 0) first_bad_ = scanned + hit;
      }
      scanned = whole;
      if (done) return;  // `whole` was read after done_ was set: nothing more will come
    }
  }

  const unsigned char* base_;
  const Lanes lanes_;
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t ready_ = 0;
  bool done_ = false;
  int64_t first_bad_ = -1;  // written by the helper only, read after join
  std::thread thread_;
};

bool SeveralCpus() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 1;
}

}  // namespace

// Index of the first non-finite element among `count` elements of `width` bytes at `data` (-1:
// none; -2: invalid width/exponent). `exponent` is E above, e.g. 0x7F for float8_e4m3fn.
extern "C" __attribute__((visibility("default"))) int64_t ModeloptJaxFindNonFinite(const void* data, int64_t count,
                                                                                   int32_t width, uint64_t exponent) {
  Lanes l;
  if (!MakeLanes(width, exponent, &l) || count < 0) return -2;
  return Find(static_cast<const unsigned char*>(data), count, l);
}


// Reads `nbytes` bytes at file offset `offset` of `fd` into `dst` and, when width > 0, scans them as
// elements of `width` bytes (exponent E as above). Returns the bytes read (fewer than asked at end
// of file) or -errno; `*first_bad` gets the index of the first non-finite element, -1 if none, -2 if
// width/exponent are invalid (then nothing is read). One call per tensor (no per-piece Python
// overhead; ctypes releases the GIL around it). A large tensor is scanned by a helper thread one
// piece behind the reads; a small one, or one on a single-CPU machine, right after each read.
extern "C" __attribute__((visibility("default"))) int64_t ModeloptJaxReadScan(int32_t fd, int64_t offset, void* dst,
                                                                              int64_t nbytes, int32_t width,
                                                                              uint64_t exponent, int64_t* first_bad) {
  *first_bad = -1;
  Lanes lanes{};
  const bool scan = width > 0;
  if (scan && (!MakeLanes(width, exponent, &lanes) || nbytes % width != 0)) {
    *first_bad = -2;
    return 0;
  }
  unsigned char* out = static_cast<unsigned char*>(dst);
  BehindScanner* helper = nullptr;
  if (scan && nbytes >= kHelperMinBytes && SeveralCpus()) {
    try {
      helper = new BehindScanner(out, lanes);
    } catch (const std::system_error&) {  // no thread to be had: scan on this one
      helper = nullptr;
    }
  }
  int64_t got = 0, scanned = 0;  // scanned: elements, when this thread scans
  int64_t error = 0;
  while (got < nbytes) {
    int64_t want = nbytes - got < kReadBytes ? nbytes - got : kReadBytes;
    ssize_t n = pread(fd, out + got, static_cast<size_t>(want), offset + got);
    if (n < 0) {
      if (errno == EINTR) continue;
      error = -errno;
      break;
    }
    if (n == 0) break;  // end of file: the caller reports the short read
    got += n;
    if (helper != nullptr) {
      helper->Publish(got);
    } else if (scan && *first_bad < 0) {
      int64_t whole = got / lanes.width;  // an element split across two reads is scanned after the second
      int64_t hit = Find(out + scanned * lanes.width, whole - scanned, lanes);
      if (hit >= 0) *first_bad = scanned + hit;
      scanned = whole;
    }
  }
  if (helper != nullptr) {
    *first_bad = helper->Finish();
    delete helper;
  }
  return error != 0 ? error : got;
}
