// Incremental SHA-256 (OpenSSL EVP) with a lowercase hex digest.
#pragma once
#include <openssl/evp.h>

#include <memory>
#include <string>

namespace moesrv {

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new(), EVP_MD_CTX_free) { reset(); }
  void reset() { EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr); }
  void update(const void* p, size_t n) { EVP_DigestUpdate(ctx_.get(), p, n); }
  // Finishes the digest; call reset() before reusing.
  std::string hex() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned len = 0;
    EVP_DigestFinal_ex(ctx_.get(), md, &len);
    static const char* digits = "0123456789abcdef";
    std::string out;
    for (unsigned i = 0; i < len; ++i) out += digits[md[i] >> 4], out += digits[md[i] & 15];
    return out;
  }

 private:
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx_;
};

}  // namespace moesrv
